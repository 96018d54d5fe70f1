"""Benchmark ``operator``: how fast the real operator turns a ModelServer into pods.

The operator runs as its own process (``python -m kvshare.cli operator``) against kmock's
Kubernetes emulator over HTTP (the tests' subclass, ``tests/operator/kube.py``), with 10
GPU nodes of 8 x 80 GiB. ModelServers (2 replicas each) are created one after another;
for each, ``reconcile`` is the time from the API server receiving the ModelServer to it
receiving the last of its pods and its status (both timestamped by the emulator, so
polling adds nothing). ``reconcile_p50_ms`` is the median over ``modelservers``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kmock  # noqa: E402
from tests.operator.harness import MS, Cluster, Gpu, OperatorProcess, wait_for, write_kubeconfig  # noqa: E402
from tests.operator.kube import KubeCluster, declare_resources  # noqa: E402
from tests.operator.specs import modelserver  # noqa: E402

from harness import Result, Target, percentile  # noqa: E402

REPLICAS = 2
NODES = 10


def _finished(cluster: Cluster, name: str, first_call: int) -> float | None:
    """Seconds from the ModelServer's create to its last pod and its status, once both came.

    ``first_call``: the length of the emulator's call log just before the create was sent.
    """
    calls = cluster.emulator.api_calls
    created_at = next(
        c.at for c in calls[first_call:] if c.verb == "create" and c.resource == "modelservers"
    )
    pods = set()
    status_at = None
    for call in calls[first_call:]:
        if "kvshare" not in call.user_agent:
            continue
        if (
            call.verb == "create"
            and call.resource == "pods"
            and (call.name or "").startswith(f"{name}-")
        ):
            pods.add((call.name, call.at))
        elif call.verb == "patch" and call.resource == "modelservers/status" and call.name == name:
            status_at = status_at or call.at
    if len(pods) < REPLICAS or status_at is None:
        return None
    return max(status_at, *(at for _, at in pods)) - created_at


async def _measure(count: int, workdir: Path) -> list[float]:
    emulator = KubeCluster()
    declare_resources(emulator)
    async with emulator, kmock.Server(emulator) as server:
        cluster = Cluster(
            emulator, server, write_kubeconfig(workdir / "kubeconfig", str(server.url))
        )
        await cluster.create(
            "kopf.dev/v1/clusterkopfpeerings",
            {
                "apiVersion": "kopf.dev/v1",
                "kind": "ClusterKopfPeering",
                "metadata": {"name": "kvshare"},
            },
        )
        for n in range(NODES):
            await cluster.add_gpu_node(f"gpu-node-{n}", [Gpu(f"GPU-{n}-{g}") for g in range(8)])
        process = OperatorProcess(cluster.kubeconfig, workdir / "operator.log", "bench")
        try:
            await wait_for(process.metrics_port, "the operator to start")
            # One ModelServer first, so that start-up is not measured.
            await cluster.create(MS, modelserver("warmup", replicas=REPLICAS))
            await wait_for(lambda: cluster.status("warmup").get("replicas") == REPLICAS, "warm-up")
            samples = []
            for i in range(count):
                name = f"model-{i:03d}"
                first_call = len(emulator.api_calls)
                await cluster.create(MS, modelserver(name, replicas=REPLICAS))
                samples.append(
                    await wait_for(lambda n=name, f=first_call: _finished(cluster, n, f), name)
                )
            return samples
        finally:
            await process.stop()


def run(quick: bool) -> Result:
    count = 20 if quick else 100
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-") as workdir:
        samples = asyncio.run(_measure(count, Path(workdir)))
    millis = [s * 1000 for s in samples]
    return Result(
        name="operator",
        fields={
            "modelservers": count,
            "replicas_each": REPLICAS,
            "reconcile_p50_ms": round(statistics.median(millis), 2),
            "reconcile_p95_ms": round(percentile(millis, 95), 2),
        },
        targets=[Target("reconcile_p50_ms", "<=", 50.0)],
        notes="operator process against kmock over HTTP; emulator-side timestamps",
    )
