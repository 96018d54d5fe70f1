"""Replicas whose pods keep failing, through the running operator: each failed pod stays
for a delay that doubles with every failure in a row before it is replaced (never a tight
delete/create loop), the ModelServer is Degraded with the pod and the reason meanwhile, and
a replica that turns ready clears it.

kopf runs for real against kmock (see ``kube.py``); the test plays the kubelet, which
fails a pod when the node refuses its GPUs at admission or the engine is killed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.operator.harness import (
    MS,
    NAMESPACE,
    PODS,
    Cluster,
    Gpu,
    StartOperator,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio

#: The operator's --replica-backoff for this test: 1 s, then 2 s.
INITIAL = 1.0


async def fail(cluster: Cluster, pod: str, status: dict[str, Any]) -> float:
    """The kubelet reports ``pod`` Failed; when it did (``time.monotonic()``)."""
    at = time.monotonic()
    body = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}], **status}
    await cluster.patch(PODS, NAMESPACE, pod, {"status": body}, status=True)
    return at


def pod_calls(cluster: Cluster, verb: str) -> list[float]:
    """When the operator made each ``verb`` call on pod qwen-0."""
    return [
        call.at
        for call in cluster.emulator.api_calls
        if call.verb == verb and call.resource == "pods" and call.name == "qwen-0"
        and call.user_agent.startswith("kvshare-operator/")
    ]  # fmt: skip


def degraded_message(cluster: Cluster) -> str:
    condition = cluster.condition("qwen", "Degraded")
    ok = condition.get("status") == "True" and condition.get("reason") == "ReplicaFailing"
    return str(condition["message"]) if ok else ""


async def new_pod(cluster: Cluster, old_uid: str) -> dict[str, Any]:
    def replaced() -> dict[str, Any] | None:
        pod = cluster.pods().get("qwen-0")
        return pod if pod and pod["metadata"]["uid"] != old_uid else None

    return await wait_for(replaced, "qwen-0 replaced")


async def test_failed_pods_are_replaced_after_growing_delays_and_say_why(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    start_operator("operator-a", "--replica-backoff", str(INITIAL), "--replica-backoff-max", "60")
    await cluster.create(MS, modelserver(replicas=1))
    first = await wait_for(lambda: cluster.pods().get("qwen-0"), "qwen-0")

    # The node agent refuses the GPUs at admission: the kubelet fails the pod.
    failed_at = await fail(
        cluster,
        "qwen-0",
        {"reason": "UnexpectedAdmissionError", "message": "Allocate failed: GPU-1a is draining"},
    )
    message = await wait_for(lambda: degraded_message(cluster), "Degraded: ReplicaFailing")
    assert message == (
        "pod qwen-0 failed once (UnexpectedAdmissionError: Allocate failed: GPU-1a is "
        "draining); replica 0 is replaced 1s after its last failure"
    )
    assert cluster.status("qwen")["phase"] == "Degraded"
    second = await new_pod(cluster, first["metadata"]["uid"])
    # The failed pod stayed for the whole delay (however slow this machine is, never less).
    (deleted_at,) = pod_calls(cluster, "delete")
    assert deleted_at - failed_at >= INITIAL

    # The engine of the next pod is killed: the second failure in a row waits twice as long.
    engine = {"name": "engine", "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
    failed_again_at = await fail(cluster, "qwen-0", {"containerStatuses": [engine]})
    await wait_for(
        lambda: (
            "failed 2 times in a row (container engine: OOMKilled, exit code 137)"
            in degraded_message(cluster)
        ),
        "the second failure in the Degraded condition",
    )
    third = await new_pod(cluster, second["metadata"]["uid"])
    assert pod_calls(cluster, "delete")[1] - failed_again_at >= 2 * INITIAL
    assert "replica 0 is replaced 2s after its last failure" in degraded_message(cluster)

    # The third pod serves: Degraded clears, and no pod was made in between.
    await cluster.set_ready("qwen-0")
    await wait_for(lambda: cluster.status("qwen").get("phase") == "Ready", "phase Ready")
    assert cluster.condition("qwen", "Degraded")["reason"] == "AsExpected"
    assert len(pod_calls(cluster, "create")) == 3
    assert cluster.pods()["qwen-0"]["metadata"]["uid"] == third["metadata"]["uid"]
    warnings = await wait_for(
        lambda: len(cluster.events("ReplicaFailing")) == 2 and cluster.events("ReplicaFailing"),
        "a ReplicaFailing event per failure",
    )
    assert all(e["type"] == "Warning" for e in warnings)
    messages = sorted(e["message"] for e in warnings)  # Events list by name, not by time
    assert "failed once (UnexpectedAdmissionError" in messages[1]
    assert "failed 2 times in a row (container engine: OOMKilled" in messages[0]
    assert cluster.get(MS, NAMESPACE, "qwen") is not None
