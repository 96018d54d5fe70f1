"""KV priorities an administrator grants: a ModelServer asking for more than its
namespace may use runs at the ceiling, and says so (condition and Event), through the
running operator; a namespace granted more keeps what it asked for."""

from __future__ import annotations

import json

import pytest

from kvshare.api import env, names
from tests.operator.harness import MS, Cluster, Gpu, StartOperator, wait_for
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio


def engine_env(pod: dict[str, object]) -> dict[str, str]:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]  # type: ignore[index]
    return {e["name"]: e.get("value", "") for e in engine["env"]}


async def test_a_priority_above_the_namespaces_ceiling_is_capped_visibly(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    start_operator("operator-a", "--kv-priority-default=100", "--kv-priority=gold=900")
    await cluster.create(MS, modelserver(kvCache={"priority": 1000}))
    capped = await wait_for(
        lambda: (
            cluster.condition("qwen", "PriorityAllowed").get("status") == "False"
            and cluster.condition("qwen", "PriorityAllowed")
        ),
        "PriorityAllowed=False",
    )
    assert capped["reason"] == "PriorityCapped"
    assert capped["message"].startswith(
        "kvCache.priority 1000 is above 100, the most namespace llm may use: its replicas run "
        "at 100"
    )
    (event,) = await wait_for(lambda: cluster.events("PriorityCapped"), "a PriorityCapped event")
    assert event["type"] == "Warning"
    pod = await wait_for(lambda: cluster.pods().get("qwen-0"), "the replica")
    assert engine_env(pod)[env.KV_PRIORITY.name] == "100"
    policy = json.loads(pod["metadata"]["annotations"][names.ANNOTATION_KV_POLICY])
    assert policy["priority"] == 100
    assert cluster.status("qwen")["phase"] != "Degraded"  # capped, still served
