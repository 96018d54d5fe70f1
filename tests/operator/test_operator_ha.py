"""More than one operator process: killed in the middle of a reconcile and restarted, or
two replicas at once (kopf peering keeps exactly one active)."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
import pytest

from kvshare.api import names
from tests.operator.harness import (
    MS,
    NAMESPACE,
    Cluster,
    Gpu,
    StartOperator,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio


def pod_creates(cluster: Cluster) -> list[str]:
    """Names of the pods the operator asked to create, in order (including refused ones)."""
    return [
        call.name or ""
        for call in cluster.emulator.api_calls
        if call.verb == "create" and call.resource == "pods" and "kvshare" in call.user_agent
    ]


def peers(cluster: Cluster) -> dict[str, Any]:
    """The operators announced in the ClusterKopfPeering, by identity."""
    peering = cluster.get("kopf.dev/v1/clusterkopfpeerings", None, names.PEERING_NAME) or {}
    return dict(peering.get("status") or {})


async def test_a_restart_after_a_kill_mid_reconcile_duplicates_and_loses_no_pod(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    # Hold the API's answer to the second pod create: the pod is stored, the operator
    # is still waiting for the reply when it is killed.
    held = asyncio.Event()
    release = asyncio.Event()
    creates: list[str] = []

    async def hold_second_create(request: kmock.Request) -> None:
        creates.append(request.data["metadata"]["name"])
        if len(creates) == 2:
            held.set()
            await release.wait()
        raise NotImplementedError  # then the emulator answers as usual

    cluster.emulator[kmock.action.CREATE, kmock.resource("v1/pods")] << hold_second_create
    first = start_operator("operator-0")
    await cluster.create(MS, modelserver(replicas=3))
    await asyncio.wait_for(held.wait(), 60)
    first.kill()
    assert sorted(cluster.pods()) == ["qwen-0", "qwen-1"]

    # The same pod restarts its operator container (same identity, as in a Deployment).
    start_operator("operator-0")
    await wait_for(lambda: cluster.status("qwen").get("replicas") == 3, "three replicas")
    release.set()
    pods = cluster.pods()
    assert sorted(pods) == ["qwen-0", "qwen-1", "qwen-2"]
    assert sorted(p["metadata"]["labels"][names.LABEL_REPLICA] for p in pods.values()) == [
        "0",
        "1",
        "2",
    ]
    # The restarted operator created only the missing replica.
    assert creates == ["qwen-0", "qwen-1", "qwen-2"]
    await wait_for(lambda: cluster.condition("qwen", "Placed").get("status") == "True", "Placed")


async def test_a_second_operator_stands_by_until_the_first_one_exits(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    first = start_operator("operator-a")
    await wait_for(lambda: "operator-a" in peers(cluster), "operator-a in the peering")
    second = start_operator("operator-b")
    await wait_for(lambda: "operator-b" in peers(cluster), "operator-b in the peering")
    # kopf starts a peered operator paused; it resumes only when no peer outranks it.

    await cluster.create(MS, modelserver(replicas=2))
    await wait_for(lambda: cluster.status("qwen").get("replicas") == 2, "two replicas")
    await asyncio.sleep(1.0)  # room for a second, wrongly active operator to act
    assert pod_creates(cluster) == ["qwen-0", "qwen-1"]
    assert "Resuming operations" not in second.log()
    placed = await wait_for(lambda: len(cluster.events("Placed")) == 2 and cluster.events("Placed"),
                            "two Placed events")  # fmt: skip
    assert {e["reportingInstance"] for e in placed} == {"operator-a"}

    assert await first.stop() == 0
    await wait_for(lambda: "Resuming operations" in second.log(), "operator-b to take over")
    await cluster.patch(MS, NAMESPACE, "qwen", {"spec": {"replicas": 3}})
    await wait_for(lambda: "qwen-2" in cluster.pods(), "qwen-2 from operator-b")
    assert pod_creates(cluster) == ["qwen-0", "qwen-1", "qwen-2"]
    latest = await wait_for(lambda: len(cluster.events("Placed")) == 3 and cluster.events("Placed"),
                            "a third Placed event")  # fmt: skip
    assert [e["reportingInstance"] for e in latest if "qwen-2" in e["message"]] == ["operator-b"]
