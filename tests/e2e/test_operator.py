"""The operator's scenarios on a real cluster: what kmock cannot show (the scheduler
binding pods to the planned node, garbage collection, the operator's own Deployment)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kvshare.api import names
from tests.polling import wait_until

pytestmark = pytest.mark.cluster

T = TypeVar("T")
TIMEOUT = 180.0


def eventually(check: Callable[[], T], what: str, timeout: float = TIMEOUT) -> T:
    """``wait_until`` at a pace a real API server does not mind."""
    return wait_until(check, timeout, what, interval=1.0)


def modelserver(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.MODELSERVER_KIND,
        "metadata": {"name": name},
        "spec": {
            "engine": "vllm",
            "image": "vllm/vllm-openai:v0.33.0",
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "staticMemory": "2Gi",
            "kvCache": {"min": "1Gi"},
            **spec,
        },
    }


class Api:
    def __init__(self, kube: Any, namespace: str) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.core = client.CoreV1Api(kube)
        self.custom = client.CustomObjectsApi(kube)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(
            names.GROUP, names.VERSION, self.namespace, names.MODELSERVER_PLURAL, body
        ))  # fmt: skip

    def get(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(
            names.GROUP, names.VERSION, self.namespace, names.MODELSERVER_PLURAL, name
        ))  # fmt: skip

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            names.GROUP, names.VERSION, self.namespace, names.MODELSERVER_PLURAL, name
        )

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for condition in self.get(name).get("status", {}).get("conditions") or ():
            if condition["type"] == kind:
                return dict(condition)
        return {}

    def pods(self, name: str) -> list[Any]:
        selector = f"{names.LABEL_MODELSERVER}={name}"
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)


def test_pods_are_bound_to_the_planned_node_and_deleted_with_their_modelserver(
    kube: Any, namespace: str
) -> None:
    api = Api(kube, namespace)
    api.create(modelserver("tiny", replicas=2))
    pods = eventually(lambda: len(api.pods("tiny")) == 2 and api.pods("tiny"), "two pods")
    for pod in pods:
        planned = pod.metadata.annotations[names.ANNOTATION_NODE]
        eventually(lambda p=pod: api.core.read_namespaced_pod(p.metadata.name, namespace)
                   .spec.node_name, "the scheduler to bind the pod")  # fmt: skip
        bound = api.core.read_namespaced_pod(pod.metadata.name, namespace).spec.node_name
        assert bound == planned
    eventually(lambda: api.condition("tiny", "Placed").get("status") == "True", "Placed")
    assert (
        api.core.read_namespaced_service("tiny", namespace).spec.selector[names.LABEL_MODELSERVER]
        == "tiny"
    )

    api.delete("tiny")
    eventually(lambda: not api.pods("tiny"), "the garbage collector to delete the pods")
    eventually(
        lambda: all(
            s.metadata.name != "tiny" for s in api.core.list_namespaced_service(namespace).items
        ),
        "the garbage collector to delete the Service",
    )


def test_a_replica_no_node_can_hold_is_degraded_without_pods(kube: Any, namespace: str) -> None:
    api = Api(kube, namespace)
    api.create(modelserver("wide", tensorParallelSize=8, staticMemory="70Gi"))
    degraded = eventually(lambda: api.condition("wide", "Degraded").get("status") == "True"
                          and api.condition("wide", "Degraded"), "Degraded")  # fmt: skip
    assert degraded["reason"] == "ModelTooLarge"
    assert api.pods("wide") == []


def test_restarting_the_operator_keeps_every_pod(kube: Any, namespace: str) -> None:
    api = Api(kube, namespace)
    api.create(modelserver("steady", replicas=2))
    eventually(lambda: len(api.pods("steady")) == 2, "two pods")
    before = sorted(p.metadata.uid for p in api.pods("steady"))
    operators = api.core.list_pod_for_all_namespaces(
        label_selector="app.kubernetes.io/component=operator"
    ).items
    assert operators, "no operator pod found: install the kvshare chart first"
    for pod in operators:
        api.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace)
    old = {pod.metadata.uid for pod in operators}

    def restarted() -> bool:
        pods = api.core.list_pod_for_all_namespaces(
            label_selector="app.kubernetes.io/component=operator"
        ).items
        return any(
            p.metadata.uid not in old
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())
            for p in pods
        )

    eventually(restarted, "a new operator pod to be ready")
    api.custom.patch_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.MODELSERVER_PLURAL, "steady",
        {"spec": {"replicas": 3}},
    )  # fmt: skip
    eventually(lambda: len(api.pods("steady")) == 3, "the third replica from the new operator")
    uids = {p.metadata.uid for p in api.pods("steady")}
    assert set(before) <= uids, "a replica was replaced by the restart"


def test_a_waiting_replica_is_placed_when_another_modelserver_scales_down(
    kube: Any, namespace: str
) -> None:
    """Needs one node agent with fake GPUs of 80Gi (``--fake-gpus 2x80Gi``)."""
    api = Api(kube, namespace)
    api.create(modelserver("filler", tensorParallelSize=2, staticMemory="70Gi"))
    eventually(lambda: len(api.pods("filler")) == 1, "filler placed")
    api.create(modelserver("late", staticMemory="20Gi"))
    placed = eventually(lambda: api.condition("late", "Placed").get("status") == "False"
                        and api.condition("late", "Placed"), "late unschedulable")  # fmt: skip
    assert placed["reason"] == "Unschedulable" and "largest:" in placed["message"]
    api.custom.patch_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.MODELSERVER_PLURAL, "filler",
        {"spec": {"replicas": 0}},
    )  # fmt: skip
    eventually(lambda: len(api.pods("late")) == 1, "late placed once filler's pod is gone")


def test_a_spec_change_replaces_one_replica_and_waits_for_it(kube: Any, namespace: str) -> None:
    """Without GPUs the engines never become ready, so the rollout stops after the first
    replacement: exactly what one-at-a-time means."""
    api = Api(kube, namespace)
    api.create(modelserver("rolling", replicas=2))
    eventually(lambda: len(api.pods("rolling")) == 2, "two pods")
    api.custom.patch_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.MODELSERVER_PLURAL, "rolling",
        {"spec": {"image": "vllm/vllm-openai:v0.33.1"}},
    )  # fmt: skip

    def images() -> list[str]:
        return sorted(p.spec.containers[0].image for p in api.pods("rolling")
                      if not p.metadata.deletion_timestamp)  # fmt: skip

    eventually(lambda: "vllm/vllm-openai:v0.33.1" in images(), "the first replacement")
    time.sleep(15)
    assert images() == ["vllm/vllm-openai:v0.33.0", "vllm/vllm-openai:v0.33.1"]
    assert api.condition("rolling", "Progressing")["reason"] == "RollingUpdate"


def test_only_one_operator_replica_acts(kube: Any, namespace: str) -> None:
    """Meaningful with the chart's ``operator.replicas=2``: both announce themselves,
    every Event comes from one of them."""
    api = Api(kube, namespace)
    peering = api.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings",
                                                   names.PEERING_NAME)  # fmt: skip
    peers = peering.get("status") or {}
    assert peers, "no operator announced itself in the ClusterKopfPeering"
    api.create(modelserver("single", replicas=2))
    eventually(lambda: len(api.pods("single")) == 2, "two pods")
    events = eventually(lambda: [e for e in api.core.list_namespaced_event(namespace).items
                                 if e.reason == "Placed"], "Placed events")  # fmt: skip
    assert len({e.reporting_instance for e in events}) == 1
