"""The ``scale`` subresource end to end: ``kubectl scale`` (a merge patch of the Scale)
and a HorizontalPodAutoscaler or KEDA (a read, then a replace of the Scale) change the
replicas through the same placement and scaling rules as a spec change.

The emulated API server serves the subresource from the CRD's own paths (see
``kube.py``), so the test also pins that the generated CRD points at the right fields.
"""

from __future__ import annotations

import pytest

from kvshare.api import names
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


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether the equality-based label ``selector`` matches ``labels``."""
    pairs = (term.split("=", 1) for term in selector.split(","))
    return all(labels.get(key) == value for key, value in pairs)


async def test_the_scale_subresource_adds_and_removes_replicas_like_a_spec_change(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    start_operator()
    await cluster.create(MS, modelserver(replicas=1))
    await all_ready(cluster, "qwen", 1)

    # kubectl scale ms qwen --replicas=3
    await cluster.patch(MS, NAMESPACE, "qwen", {"spec": {"replicas": 3}}, subresource="scale")
    await wait_for(lambda: sorted(cluster.pods()) == ["qwen-0", "qwen-1", "qwen-2"], "3 pods")
    await wait_for(lambda: len(cluster.events("Placed")) == 3, "three Placed events")
    await wait_for(lambda: cluster.status("qwen").get("ready") == "1/3", "1/3 ready")

    # An autoscaler reads the Scale: replicas and the selector that finds the pods.
    scale = await cluster.scale("qwen")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 3
    pods = cluster.pods()
    assert all(selects(scale["status"]["selector"], p["metadata"]["labels"]) for p in pods.values())
    other = {names.LABEL_MODELSERVER: "other", names.LABEL_MANAGED_BY: names.MANAGED_BY}
    assert not selects(scale["status"]["selector"], other)

    # ... and replaces it with its recommendation: the highest replicas go first.
    await cluster.replace_scale("qwen", {**scale, "spec": {"replicas": 1}})
    await wait_for(lambda: sorted(cluster.pods()) == ["qwen-0"], "scaled back to 1")
    await wait_for(lambda: cluster.status("qwen").get("ready") == "1/1", "1/1 ready")
    assert cluster.get(MS, NAMESPACE, "qwen")["spec"]["replicas"] == 1  # type: ignore[index]
    await wait_for(
        lambda: (
            {e["message"] for e in cluster.events("Scaled")}
            == {"replicas 1 -> 3", "replicas 3 -> 1"}
        ),
        "a Scaled event each way",
    )
    assert (await cluster.scale("qwen"))["status"]["replicas"] == 1
