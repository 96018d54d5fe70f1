"""Placement in the cluster, through the running operator: replicas wait with the reason
until a GPU has room, planned pods hold their GPUs before the node agent reports them,
and specs only the operator can judge are refused without pods."""

from __future__ import annotations

import pytest

from kvshare.api.kvsharenode import PoolStatus
from tests.operator.harness import (
    GIB,
    MS,
    NAMESPACE,
    SERVICES,
    Cluster,
    Gpu,
    StartOperator,
    eventually,
    metric,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio


def foreign_pool(name: str, size: int) -> PoolStatus:
    """A pool of a workload the operator does not manage (a notebook, another team's pod)."""
    return PoolStatus(namespace="lab", pod=name, modelserver="notebook", static=size)


async def test_unschedulable_replicas_say_why_and_are_placed_once_a_gpu_has_room(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    gpus = [Gpu("GPU-3a", pools=[foreign_pool("nb-0", 49 * GIB)]),
            Gpu("GPU-3b", pools=[foreign_pool("nb-1", 49 * GIB)])]  # fmt: skip
    await cluster.add_gpu_node("gpu-node-3", gpus)
    start_operator()
    await cluster.create(MS, modelserver(tensorParallelSize=2, staticMemory="34Gi",
                                         kvCache={"min": "4Gi"}))  # fmt: skip

    placed = await wait_for(
        lambda: (
            cluster.condition("qwen", "Placed").get("status") == "False"
            and cluster.condition("qwen", "Placed")
        ),
        "Placed=False",
    )
    assert placed["reason"] == "Unschedulable"
    assert placed["message"] == (
        "1 of 1 replicas cannot be placed: no node has 2 GPUs with 38Gi free and a free slot "
        "(largest: 31Gi on gpu-node-3)"
    )
    assert cluster.status("qwen")["phase"] == "Unschedulable"
    (event,) = await wait_for(lambda: cluster.events("Unschedulable"), "an Unschedulable event")
    assert event["type"] == "Warning" and "38Gi" in event["message"]
    assert cluster.pods() == {}

    # The notebooks end: the node agent reports the room, and the replica is placed.
    for gpu in gpus:
        gpu.pools.clear()
    await cluster.publish_gpu_node("gpu-node-3", gpus)
    await wait_for(lambda: list(cluster.pods()) == ["qwen-0"], "the replica placed")
    await wait_for(lambda: cluster.condition("qwen", "Placed").get("status") == "True", "Placed")
    assert cluster.status("qwen")["phase"] == "Starting"


async def test_planned_pods_hold_their_gpu_before_the_node_agent_reports_them_and_after(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    gpus = [Gpu("GPU-1a")]
    await cluster.add_gpu_node("gpu-node-1", gpus)
    process = start_operator()
    await cluster.create(MS, modelserver("big", staticMemory="46Gi", kvCache={"min": "4Gi"}))
    await wait_for(lambda: "big-0" in cluster.pods(), "big-0 placed")
    # The node agent still reports an empty GPU: the planned pod must count anyway.
    await cluster.create(MS, modelserver("small", staticMemory="36Gi", kvCache={"min": "4Gi"}))
    expected = (
        "1 of 1 replicas cannot be placed: no node has 1 GPU with 40Gi free and a free slot "
        "(largest: 30Gi on gpu-node-1)"
    )
    await wait_for(lambda: cluster.condition("small", "Placed").get("message") == expected,
                   "small unschedulable")  # fmt: skip

    # Now the agent reports big-0's pool too: it must not be counted a second time.
    attempts = (await metric(process, "kvshare_operator_placements_total"))[
        '{result="unschedulable"}'
    ]
    gpus[0].pools.append(PoolStatus(namespace=NAMESPACE, pod="big-0", modelserver="big",
                                    static=46 * GIB, kv_min=4 * GIB, lease=8 * GIB))  # fmt: skip
    await cluster.publish_gpu_node("gpu-node-1", gpus)

    async def retried() -> bool:
        samples = await metric(process, "kvshare_operator_placements_total")
        return samples['{result="unschedulable"}'] > attempts

    await eventually(retried, "small to be placed again after the KVShareNode update")
    await wait_for(lambda: cluster.status("big").get("kv", {}).get("lease") == "8Gi", "big's KV")
    assert cluster.condition("small", "Placed")["message"] == expected
    assert sorted(cluster.pods()) == ["big-0"]


async def test_specs_only_the_operator_can_judge_are_degraded_and_get_no_pods(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    start_operator()
    await cluster.create(MS, modelserver("old", image="vllm/vllm-openai:v0.20.1"))
    await cluster.create(MS, modelserver("huge", staticMemory="200Gi"))
    # kvCache.min above max: the CRD's CEL rule refuses it, but an older CRD may not have.
    await cluster.create(MS, modelserver("bad", kvCache={"min": "50Gi", "max": "40Gi"}))

    expected = {
        "old": ("UnsupportedEngineVersion", "vllm 0.20.1 is not supported by this kvshare version"),
        "huge": ("ModelTooLarge", "each worker needs 204.0Gi"),
        "bad": ("InvalidSpec", "kvCache: kvCache.min (50Gi) exceeds kvCache.max (40Gi)"),
    }
    for name, (reason, message) in expected.items():
        degraded = await wait_for(
            lambda n=name: (
                cluster.condition(n, "Degraded").get("status") == "True"
                and cluster.condition(n, "Degraded")
            ),
            f"{name} degraded",
        )
        assert degraded["reason"] == reason
        assert message in degraded["message"]
        assert cluster.condition(name, "Placed")["status"] == "False"
        assert cluster.status(name)["phase"] == "Degraded"
        await wait_for(lambda r=reason: cluster.events(r), f"a {reason} event")
    assert cluster.pods() == {}

    # Fixing the spec clears the condition and the replica is placed.
    await cluster.patch(MS, NAMESPACE, "old", {"spec": {"image": "vllm/vllm-openai:v0.30.2"}})
    await wait_for(lambda: "old-0" in cluster.pods(), "old-0 placed")
    await wait_for(lambda: cluster.condition("old", "Degraded").get("status") == "False",
                   "Degraded cleared")  # fmt: skip
    assert sorted(cluster.pods()) == ["old-0"]


async def test_modelservers_reconciled_at_once_never_share_the_last_room(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a", total=48 * GIB)])
    # Both exist before the operator starts: it reconciles them concurrently.
    for name in ("first", "second", "third"):
        await cluster.create(MS, modelserver(name, staticMemory="26Gi", kvCache={"min": "4Gi"}))
    start_operator()
    phases = await wait_for(
        lambda: (
            sorted(cluster.status(n).get("phase", "") for n in ("first", "second", "third"))
            if all(cluster.status(n).get("phase") for n in ("first", "second", "third"))
            else None
        ),
        "three statuses",
    )
    assert phases == ["Starting", "Unschedulable", "Unschedulable"]
    assert len(cluster.pods()) == 1


async def test_a_service_of_the_same_name_that_is_not_its_own_is_left_alone(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "qwen", "namespace": NAMESPACE},
               "spec": {"selector": {"app": "legacy"}, "ports": [{"port": 80}]}}  # fmt: skip
    await cluster.create(SERVICES, foreign)
    start_operator()
    await cluster.create(MS, modelserver())
    degraded = await wait_for(lambda: cluster.condition("qwen", "Degraded").get("status") == "True"
                              and cluster.condition("qwen", "Degraded"), "Degraded")  # fmt: skip
    assert degraded["reason"] == "ServiceNameTaken"
    assert cluster.get(SERVICES, NAMESPACE, "qwen")["spec"]["selector"] == {"app": "legacy"}  # type: ignore[index]
    assert list(cluster.pods()) == ["qwen-0"]


async def test_a_waiting_replica_takes_the_room_another_modelservers_pod_leaves(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    start_operator()
    await cluster.create(MS, modelserver("first", staticMemory="56Gi", kvCache={"min": "4Gi"}))
    await wait_for(lambda: "first-0" in cluster.pods(), "first-0 placed")
    await cluster.create(MS, modelserver("second", staticMemory="36Gi", kvCache={"min": "4Gi"}))
    await wait_for(lambda: cluster.status("second").get("phase") == "Unschedulable", "second waits")
    # No KVShareNode update: the pod going away is what frees the room.
    await cluster.patch(MS, NAMESPACE, "first", {"spec": {"replicas": 0}})
    await wait_for(lambda: list(cluster.pods()) == ["second-0"], "second-0 placed")


async def test_colocation_rules_naming_missing_modelservers_are_reported_until_they_exist(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    start_operator()
    await cluster.create(
        MS, modelserver(colocateWith=["llama"], avoidColocationWith=["mistral", "qwen-small"])
    )
    await cluster.create(MS, modelserver("qwen-small", staticMemory="4Gi", kvCache={"min": "1Gi"}))

    def resolved() -> dict[str, object]:
        return cluster.condition("qwen", "ResolvedRefs")

    await wait_for(lambda: resolved().get("status") == "False", "ResolvedRefs=False")
    assert resolved()["reason"] == "ModelServerNotFound"
    assert resolved()["message"] == (
        "colocateWith names llama; avoidColocationWith names mistral: no ModelServer of "
        "that name in namespace llm (placement ignores the names until they exist)"
    )
    (event,) = await wait_for(lambda: cluster.events("ModelServerNotFound"), "a Warning event")
    assert event["type"] == "Warning" and "llama" in event["message"]
    # Still placed: a missing name is a preference that cannot apply yet, not an error.
    await wait_for(lambda: "qwen-0" in cluster.pods(), "qwen placed anyway")

    await cluster.create(MS, modelserver("llama", staticMemory="4Gi", kvCache={"min": "1Gi"}))
    await wait_for(lambda: "llama" not in resolved().get("message", "x"), "llama found")
    assert resolved()["message"].startswith("avoidColocationWith names mistral: ")
    await cluster.create(MS, modelserver("mistral", staticMemory="4Gi", kvCache={"min": "1Gi"}))
    await wait_for(lambda: resolved().get("status") == "True", "every name found")
    assert resolved()["reason"] == "ResolvedRefs"

    await cluster.delete(MS, NAMESPACE, "llama")
    await wait_for(lambda: resolved().get("status") == "False", "llama gone again")
    assert resolved()["message"].startswith("colocateWith names llama: ")
