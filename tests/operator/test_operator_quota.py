"""Namespace GPU-memory quotas (as the chart makes them from its values) against the
operator: the emulated API server admits pods as a quota-enforcing one does (HTTP 403
with the ``exceeded quota`` message, and the quota controller recounting
``status.used``, see ``kube.py``).

A ModelServer whose next pod does not fit reports ``Placed=False``/``QuotaExceeded``
naming the quota, what the pod asks and what is left, posts one Warning, tries nothing
more while the quota has no room, and creates the pod once another team member's
replicas free it."""

from __future__ import annotations

import pytest

from kvshare.api import names
from tests.chart.helm import template
from tests.operator.harness import (
    MS,
    NAMESPACE,
    Cluster,
    Gpu,
    StartOperator,
    all_ready,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio

QUOTAS = "v1/resourcequotas"
GPU_MEMORY = f"requests.{names.RESOURCE_GPU_MEMORY}"


def attempts(cluster: Cluster, pod: str) -> int:
    """How often the operator tried to create ``pod``."""
    return sum(
        c.verb == "create" and c.resource == "pods" and c.name == pod
        for c in cluster.emulator.api_calls
    )


async def test_a_full_quota_holds_the_replica_back_until_other_pods_free_it(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    gpus = [Gpu("GPU-1a"), Gpu("GPU-1b")]
    await cluster.add_gpu_node("gpu-node-1", gpus)
    # The team's quota, as the chart makes it from its values: 48 GiB of GPU memory.
    # Each replica asks 18Gi + 4Gi = 22 units.
    rendered = template({"quotas": [{"namespace": NAMESPACE, "gpuMemory": 48}]})
    quota = rendered.one("ResourceQuota")
    await cluster.create(QUOTAS, quota)
    name = quota["metadata"]["name"]
    start_operator()
    await cluster.create(MS, modelserver("batch", replicas=1))
    await all_ready(cluster, "batch", 1)
    await cluster.create(MS, modelserver("qwen", replicas=2))

    placed = await wait_for(
        lambda: (
            cluster.condition("qwen", "Placed").get("reason") == "QuotaExceeded"
            and cluster.condition("qwen", "Placed")
        ),
        "qwen's second replica to be refused by the quota",
    )
    assert placed["status"] == "False"
    assert placed["message"] == (
        f"1 of 2 replicas wait: pod qwen-1 exceeds ResourceQuota {name} "
        f"({GPU_MEMORY}: asks 22, 4 left of 48); it is created when the quota has room: "
        "raise the quota, free it, or ask for less (replicas, kvCache.min, staticMemory, "
        "resources)"
    )
    status = cluster.status("qwen")
    assert status["phase"] == "Unschedulable"
    assert cluster.condition("qwen", "Degraded")["status"] == "False"
    (event,) = await wait_for(lambda: cluster.events("QuotaExceeded"), "a QuotaExceeded Event")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "qwen"
    assert event["message"] == placed["message"]
    assert "qwen-1" not in cluster.pods()

    # No loop: events that reconcile qwen (its pod ready, the node agent publishing) try
    # nothing until the quota changes and has room.
    tried = attempts(cluster, "qwen-1")
    assert tried == 1
    await cluster.set_ready("qwen-0")
    await wait_for(lambda: cluster.status("qwen").get("readyReplicas") == 1, "qwen-0 ready")
    assert cluster.condition("qwen", "Progressing")["reason"] == "WaitingForQuota"
    for lease in (1, 2, 3):
        gpus[0].headroom = lease * 2**20
        await cluster.publish_gpu_node("gpu-node-1", gpus)
    await cluster.set_ready("qwen-0", ready=False)
    await wait_for(lambda: cluster.status("qwen").get("readyReplicas") == 0, "qwen-0 unready")
    assert attempts(cluster, "qwen-1") == tried
    assert len(cluster.events("QuotaExceeded")) == 1

    # Another ModelServer of the team scales to zero: its pod goes, the quota controller
    # recounts, and the waiting replica is created.
    await cluster.patch(MS, NAMESPACE, "batch", {"spec": {"replicas": 0}})
    await wait_for(lambda: "qwen-1" in cluster.pods(), "qwen-1 created once the quota has room")
    await wait_for(
        lambda: cluster.condition("qwen", "Placed").get("status") == "True", "qwen Placed"
    )
    assert attempts(cluster, "qwen-1") == tried + 1
    counted = cluster.get(QUOTAS, NAMESPACE, name)
    assert counted is not None and counted["status"]["used"][GPU_MEMORY] == "44"
