"""A ModelServer's KV policy changed in place, end to end, with no pod recreated: the
operator (a real process) annotates the running pod, the node agent (a real ``kvshare
node`` process, watching the same emulated API) applies the annotation to the pod's
pool in its broker, and a real KV pool (host memory, leasing through the broker) grows
into a raised ``kvCache.max``, gives memory back under a lowered one, and takes a new
minimum and priority; the ModelServer's status says when the replica runs the policy.

The test plays the scheduler (it binds the pod to the node) and the kubelet (it
allocates the pod's slot through the agent's device plugin, lists it in its PodResources
API, and starts the pool process as the pod's engine, in the pod's cgroup, and reports it
ready): the node agent admits only a pool it can bind to a pod it knows.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvshare.api import names
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet
from tests.deviceplugin.conftest import AgentProcess, PoolProcess
from tests.deviceplugin.trust.harness import entering, pod_cgroup_root
from tests.operator.harness import (
    MS,
    NAMESPACE,
    NODES,
    PODS,
    Cluster,
    StartOperator,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio

GIB = 2**30
MIB = 2**20
NODE = "kv-node"
#: 2 GiB static + 512 MiB min: a 3-unit GPU-memory request, which also covers a 1 GiB min.
POLICY = {"min": "512Mi", "max": "4Gi", "priority": 100}


@pytest.fixture
def cgroups() -> Path:
    root = pod_cgroup_root()
    if root is None:
        pytest.skip("the pod's engine runs in a pod cgroup: needs root and a writable cgroup")
    return root


@pytest_asyncio.fixture
async def kubelet() -> AsyncIterator[StandInKubelet]:
    directory = Path(tempfile.mkdtemp(prefix="kvk", dir="/tmp"))
    kubelet = StandInKubelet(directory / "dp", pod_resources_socket=directory / "pr.sock")
    kubelet.start()
    yield kubelet
    kubelet.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest_asyncio.fixture
async def agent(cluster: Cluster, kubelet: StandInKubelet) -> AsyncIterator[AgentProcess]:
    """``kvshare node`` on one fake 16 GiB GPU of Node ``kv-node``, using the cluster's API."""
    await cluster.create(
        NODES,
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}},
    )
    directory = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))
    process = AgentProcess(
        directory,
        "1x16Gi",
        [
            "--publish-interval",
            "0.2",
            "--device-plugin-dir",
            str(kubelet.directory),
            "--pod-resources-socket",
            str(kubelet.pod_resources_socket),
        ],
        node_name=NODE,
        kubeconfig=cluster.kubeconfig,
    )
    await asyncio.to_thread(process.start)
    assert await asyncio.to_thread(kubelet.wait_registered, names.RESOURCE_GPU)
    yield process
    await asyncio.to_thread(process.stop)
    shutil.rmtree(directory, ignore_errors=True)


def pool_of(agent: AgentProcess, pod: str) -> Any:
    (pool,) = [p for p in agent.view().pools if p.pod == pod]
    return pool


async def in_agent(agent: AgentProcess, pod: str) -> Any:
    return await asyncio.to_thread(pool_of, agent, pod)


async def until(check: Any, what: str) -> Any:
    """Poll a blocking ``check`` (off the event loop, which serves the API) until truthy."""

    async def attempt() -> Any:
        try:
            return await asyncio.to_thread(check)
        except (ValueError, OSError):
            return None

    deadline = asyncio.get_running_loop().time() + 60
    while True:
        result = await attempt()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def placement(cluster: Cluster) -> dict[str, Any]:
    placements = cluster.status("qwen").get("placements") or [{}]
    return dict(placements[0])


async def test_a_patched_modelserver_moves_its_pools_limits_without_recreating_the_pod(
    cluster: Cluster,
    start_operator: StartOperator,
    agent: AgentProcess,
    kubelet: StandInKubelet,
    cgroups: Path,
) -> None:
    start_operator()
    await wait_for(lambda: cluster.get(f"{names.GROUP}/{names.VERSION}/kvsharenodes", None, NODE),
                   "the node agent's KVShareNode")  # fmt: skip
    await cluster.create(MS, modelserver(staticMemory="2Gi", kvCache=POLICY))
    pod = await wait_for(lambda: cluster.pods().get("qwen-0"), "the replica's pod")
    uid = pod["metadata"]["uid"]
    annotation = pod["metadata"]["annotations"][names.ANNOTATION_KV_POLICY]
    assert json.loads(annotation) == POLICY
    # The scheduler binds it; the kubelet allocates its slot and starts its engine in the
    # pod's cgroup: a pool leasing from the broker.
    await cluster.patch(PODS, NAMESPACE, "qwen-0", {"spec": {"nodeName": NODE}})
    slot = kubelet.healthy(names.RESOURCE_GPU)[0]
    kubelet.allocate(names.RESOURCE_GPU, [slot], pod=(NAMESPACE, "qwen-0", "engine"))
    cgroup = cgroups / f"pod{uid}"
    cgroup.mkdir(parents=True)
    engine = await asyncio.to_thread(
        PoolProcess,
        ["--socket", str(agent.broker_socket), "--gpu", agent.gpus[0].uuid,
         "--namespace", NAMESPACE, "--pod", "qwen-0", "--pod-uid", uid, "--modelserver", "qwen",
         "--static", str(2 * GIB), "--kv-min", str(512 * MIB), "--kv-max", str(4 * GIB),
         "--priority", "100", "--blocks", "4096", "--capacity", str(8 * GIB)],
        entering(cgroup),
    )  # fmt: skip
    try:
        assert engine.error is None, engine.error
        await asyncio.to_thread(engine.demand, 6 * GIB)  # more than its max allows
        await until(lambda: engine.status()["limit"] == 4 * GIB, "the lease at kvCache.max")
        await cluster.set_ready("qwen-0")
        await wait_for(lambda: placement(cluster).get("kvPolicy") == "Applied", "Applied")

        # Give the busy model more room: max 6Gi, and a higher priority, in place.
        await cluster.patch(
            MS, NAMESPACE, "qwen", {"spec": {"kvCache": {"max": "6Gi", "priority": 300}}}
        )
        await until(lambda: engine.status()["limit"] == 6 * GIB, "the pool to grow to 6Gi")
        pool = await in_agent(agent, "qwen-0")
        assert (pool.kv_max, pool.priority, pool.kv_min) == (6 * GIB, 300, 512 * MIB)
        await wait_for(lambda: placement(cluster).get("kvPolicy") == "Applied", "Applied again")
        changed = await wait_for(lambda: cluster.events("KVPolicyChanged"), "KVPolicyChanged")
        assert "min 512Mi, max 6Gi, priority 300" in changed[0]["message"]
        await wait_for(lambda: cluster.events("KVPolicyApplied"), "a KVPolicyApplied Event")

        # A lower cap and a higher minimum the pod's GPU-memory request still covers.
        await cluster.patch(
            MS, NAMESPACE, "qwen", {"spec": {"kvCache": {"min": "1Gi", "max": "2Gi"}}}
        )
        await until(lambda: engine.status()["limit"] == 2 * GIB, "the pool reclaimed to 2Gi")
        pool = await in_agent(agent, "qwen-0")
        assert (pool.kv_max, pool.kv_min) == (2 * GIB, GIB)
        await wait_for(
            lambda: (
                placement(cluster).get("kvPolicy") == "Applied"
                and cluster.status("qwen")["kv"]["min"] == "1Gi"
            ),
            "the new minimum in the status",
        )

        # A hand edit of the annotation is put back to the spec.
        edit = {"metadata": {"annotations": {names.ANNOTATION_KV_POLICY: '{"min":"9Gi"}'}}}
        await cluster.patch(PODS, NAMESPACE, "qwen-0", edit)
        await wait_for(
            lambda: (
                json.loads(
                    cluster.pods()["qwen-0"]["metadata"]["annotations"][names.ANNOTATION_KV_POLICY]
                )
                == {"min": "1Gi", "max": "2Gi", "priority": 300}
            ),
            "the operator to restore the annotation",
        )

        # The same pod throughout: nothing was deleted or created again.
        assert cluster.pods()["qwen-0"]["metadata"]["uid"] == uid
        pod_writes = [
            (c.verb, c.name)
            for c in cluster.emulator.api_calls
            if c.resource == "pods" and c.verb in ("create", "delete")
        ]
        assert pod_writes == [("create", "qwen-0")]
        assert engine.process.poll() is None
    finally:
        await asyncio.to_thread(engine.kill)
        cgroup.rmdir()
