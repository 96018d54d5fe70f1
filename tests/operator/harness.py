"""Drive the real operator against the emulated API: the cluster, the node agent's part,
and the operator processes (``python -m kvshare.cli operator``, as a Deployment runs it).

Everything a test does to the cluster goes over HTTP, like ``kubectl`` would, so kopf
sees a watch event for it. The node agent is played by the test: it publishes
KVShareNodes and marks pods ready, as the agent and the kubelet would.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import kmock

from kvshare.api import names
from kvshare.api.kvsharenode import GpuStatus, KVShareNodeStatus, PoolStatus
from tests.operator.kube import KubeCluster

GIB = 2**30
MS = f"{names.GROUP}/{names.VERSION}/{names.MODELSERVER_PLURAL}"
KSN = f"{names.GROUP}/{names.VERSION}/{names.KVSHARENODE_PLURAL}"
PODS = "v1/pods"
SERVICES = "v1/services"
NODES = "v1/nodes"
EVENTS = "v1/events"
QUOTAS = "v1/resourcequotas"
NAMESPACE = "llm"
#: Generous: the suite must pass on a loaded 2-core machine.
TIMEOUT = 60.0

T = TypeVar("T")


def _path(resource: str, namespace: str | None, name: str | None = None) -> str:
    group_version, _, plural = resource.rpartition("/")
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return f"{base}/{name}" if name else base


@dataclass
class Gpu:
    """A GPU as the node agent publishes it, with the pools on it."""

    uuid: str
    total: int = 80 * GIB
    headroom: int = 0
    slots: int = 8
    pools: list[PoolStatus] = field(default_factory=list)

    def status(self, index: int) -> GpuStatus:
        static = sum(p.static for p in self.pools)
        kv_min = sum(p.kv_min for p in self.pools)
        return GpuStatus(
            uuid=self.uuid,
            index=index,
            total=self.total,
            headroom=self.headroom,
            static=static,
            kv_min=kv_min,
            kv_lease=sum(p.lease for p in self.pools),
            kv_mapped=sum(p.mapped for p in self.pools),
            kv_used=sum(p.used for p in self.pools),
            free=self.total - self.headroom - static - kv_min,
            slots=self.slots,
            slots_used=len(self.pools),
            pools=self.pools,
        )


class Cluster:
    """The emulated API server, with verbs a test (or ``kubectl``) would use."""

    def __init__(self, emulator: KubeCluster, server: kmock.Server, kubeconfig: Path) -> None:
        self.emulator = emulator
        self.server = server
        self.kubeconfig = kubeconfig

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    async def _send(self, method: str, path: str, body: Any = None, patch: str = "merge") -> Any:
        headers = {"Content-Type": f"application/{patch}-patch+json"} if method == "PATCH" else {}
        async with self.server.client.request(method, path, json=body, headers=headers) as response:
            data = await response.json()
            if response.status >= 400:
                raise AssertionError(f"{method} {path}: {response.status} {data}")
            return data

    async def create(self, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        namespace = body.get("metadata", {}).get("namespace")
        return dict(await self._send("POST", _path(resource, namespace), body))

    async def patch(
        self,
        resource: str,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        status: bool = False,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        subresource = "status" if status else subresource
        path = _path(resource, namespace, name) + (f"/{subresource}" if subresource else "")
        return dict(await self._send("PATCH", path, body))

    async def scale(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        """GET a ModelServer's Scale, as an autoscaler reads it."""
        return dict(await self._send("GET", _path(MS, namespace, name) + "/scale"))

    async def replace_scale(
        self, name: str, scale: dict[str, Any], namespace: str = NAMESPACE
    ) -> dict[str, Any]:
        """PUT a ModelServer's Scale, as the HorizontalPodAutoscaler writes it."""
        return dict(await self._send("PUT", _path(MS, namespace, name) + "/scale", scale))

    async def delete(self, resource: str, namespace: str | None, name: str) -> None:
        await self._send("DELETE", _path(resource, namespace, name))

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return dict(self.emulator.objects[key].raw)

    def list(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        found = []
        for (res, ns, _), obj in self.emulator.objects.items():
            wanted = res == kmock.resource(resource) and namespace in (None, ns)
            if wanted and not obj.deleted:
                found.append(dict(obj.raw))
        return sorted(found, key=lambda o: o["metadata"]["name"])

    def pods(self, namespace: str = NAMESPACE) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.list(PODS, namespace)}

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        found = self.list(EVENTS)
        return [e for e in found if reason is None or e.get("reason") == reason]

    def status(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        obj = self.get(MS, namespace, name)
        return dict((obj or {}).get("status") or {})

    def condition(self, name: str, kind: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        for condition in self.status(name, namespace).get("conditions") or ():
            if condition["type"] == kind:
                return dict(condition)
        return {}

    # --- what the node agent and the kubelet do -------------------------------------

    async def add_gpu_node(
        self,
        name: str,
        gpus: Sequence[Gpu],
        labels: dict[str, str] | None = None,
        taints: Sequence[dict[str, str]] = (),
    ) -> None:
        """A Node and its KVShareNode, as a node with the node agent running would have."""
        await self.create(
            NODES,
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                },
                "spec": {"taints": list(taints)},
            },
        )
        await self.create(
            KSN,
            {
                "apiVersion": names.API_VERSION,
                "kind": names.KVSHARENODE_KIND,
                "metadata": {"name": name},
                "spec": {"nodeName": name},
                "status": self.gpu_node_status(gpus),
            },
        )

    @staticmethod
    def gpu_node_status(gpus: Sequence[Gpu]) -> dict[str, Any]:
        statuses = [gpu.status(index) for index, gpu in enumerate(gpus)]
        return KVShareNodeStatus(
            backend="host",
            gpu_count=len(gpus),
            pool_count=sum(len(g.pools) for g in gpus),
            free=sum(s.free for s in statuses),
            gpus=statuses,
        ).to_wire()

    async def publish_gpu_node(self, name: str, gpus: Sequence[Gpu]) -> None:
        """The node agent writes a new KVShareNode status."""
        await self.patch(KSN, None, name, {"status": self.gpu_node_status(gpus)}, status=True)

    async def set_ready(self, pod: str, ready: bool = True, namespace: str = NAMESPACE) -> None:
        """The kubelet reports the engine's readiness probe."""
        await self.patch(
            PODS,
            namespace,
            pod,
            {
                "status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                }
            },
            status=True,
        )


async def wait_for(check: Callable[[], T], what: str, timeout: float = TIMEOUT) -> T:
    """Poll ``check`` until it returns something truthy; fail saying ``what`` never happened."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = TIMEOUT
) -> None:
    """Like :func:`wait_for`, for a check that needs to await (e.g. an HTTP request)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


async def all_ready(cluster: Cluster, name: str, count: int) -> None:
    pods = await wait_for(lambda: len(cluster.pods()) == count and cluster.pods(), f"{count} pods")
    for pod in pods:
        await cluster.set_ready(pod)
    await wait_for(lambda: cluster.status(name).get("ready") == f"{count}/{count}", "all ready")


async def metric(process: OperatorProcess, name: str) -> dict[str, float]:
    """Samples of ``name`` on the operator's /metrics, by label string."""
    port = await wait_for(process.metrics_port, "the metrics port in the log")
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, _, value = line[len(name) :].rpartition(" ")
            samples[labels] = float(value)
    return samples


#: The ``start_operator`` fixture: ``start_operator(identity, *flags)``.
StartOperator = Callable[..., "OperatorProcess"]


def write_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: test, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: test, user: {}}]\n"
        "contexts: [{name: test, context: {cluster: test, user: test}}]\n"
        "current-context: test\n",
        encoding="utf-8",
    )
    return path


class OperatorProcess:
    """One ``kvshare operator`` process, its log in a file."""

    def __init__(self, kubeconfig: Path, log: Path, identity: str, *extra: str) -> None:
        self.log_path = log
        self.identity = identity
        self._log = log.open("ab")
        command = [
            sys.executable, "-m", "kvshare.cli", "operator",
            "--kubeconfig", str(kubeconfig),
            "--image", "registry.example/kvshare:test",
            "--metrics-port", "0",
            "--identity", identity,
            *extra,
        ]  # fmt: skip
        environment = {**os.environ, "KVSHARE_LOG_LEVEL": "INFO"}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=environment
        )

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def metrics_port(self) -> int | None:
        match = re.search(r"serving /metrics and /healthz on port (\d+)", self.log())
        return int(match.group(1)) if match else None

    async def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.process.wait, 30)
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL: the process dies wherever it is."""
        self.process.kill()
        self.process.wait(30)
        self._log.close()
