"""A KV policy changed in place, as the operator plans and reports it: the pods to
annotate, each replica's state from its pools, replacement of a replica whose node
refused it or whose GPU-memory request no longer covers kvCache.min, and the status."""

from __future__ import annotations

from dataclasses import replace

from kvshare.api.kvsharenode import PoolStatus
from kvshare.api.placement import GpuState, NodeState
from kvshare.operator.capacity import Capacity
from kvshare.operator.inplace import (
    ReplicaPolicy,
    pods_to_annotate,
    refused_replicas,
    replica_policies,
    wanted_policy,
)
from kvshare.operator.plan import Plan, desired_replicas, plan_replicas
from kvshare.operator.status import Observation, compute_status, placement_events
from kvshare.operator.views import PodView
from tests.operator.specs import GIB, NAMESPACE, parsed, pod

NOW = "2026-01-01T00:00:00Z"


def pool(pod_name: str, policy: str, refused: str = "", message: str = "") -> PoolStatus:
    return PoolStatus(
        namespace=NAMESPACE,
        pod=pod_name,
        modelserver="qwen",
        policy=policy,
        policy_refused=refused,
        policy_message=message,
    )


def annotated(view: PodView, annotation: str) -> PodView:
    return replace(view, kv_policy=annotation)


def test_pods_without_the_current_annotation_are_annotated_live_ones_only() -> None:
    wanted = wanted_policy(parsed().kv_cache)
    pods = [
        annotated(pod(0), wanted.annotation),
        annotated(pod(1), '{"min":"1Gi"}'),
        pod(2),
        replace(pod(3), terminating=True),
    ]
    assert [p.name for p in pods_to_annotate(pods, wanted)] == ["qwen-1", "qwen-2"]


def test_each_replica_reports_whether_its_pools_run_the_current_policy() -> None:
    old = wanted_policy(parsed().kv_cache)
    new = wanted_policy(parsed(kvCache={"min": "4Gi", "max": "60Gi", "priority": 200}).kv_cache)
    pools = [
        pool("qwen-0", new.revision),
        pool("qwen-0", new.revision),  # rank 1 of the same replica
        pool("qwen-1", old.revision),
        pool("qwen-2", old.revision, refused=new.revision, message="cannot guarantee 2Gi more"),
        pool("qwen-2", old.revision),
    ]
    states = replica_policies([pod(0), pod(1), pod(2), pod(3)], pools, new)
    assert states == {
        0: ReplicaPolicy("Applied"),
        1: ReplicaPolicy(
            "Pending", "runs an older kvCache; applying min 4Gi, max 60Gi, priority 200"
        ),
        2: ReplicaPolicy("Refused", "cannot guarantee 2Gi more"),
    }  # qwen-3 has no pools yet: no state
    assert refused_replicas(states) == {2}


def capacity() -> Capacity:
    node = NodeState(
        name="node-a",
        gpus=(GpuState(uuid="GPU-a0", index=0, free_bytes=70 * GIB, free_slots=8),),
        labels={},
        taints=(),
        schedulable=True,
    )
    return Capacity((node,))


def test_a_replica_is_replaced_when_its_node_refused_the_policy_or_its_request_is_short() -> None:
    spec = parsed(replicas=2)
    desired = desired_replicas(NAMESPACE, "qwen", spec, "h1")
    pods = [pod(0), pod(1)]
    assert plan_replicas(desired, pods, capacity).rollout is None
    refused = plan_replicas(desired, pods, capacity, refused={0})
    assert [(d.pod.name, d.reason) for d in refused.deletes] == [("qwen-0", "RollingUpdate")]
    # kvCache.min raised beyond what qwen-1's request (22 GiB) covers: a new pod must ask.
    bigger = desired_replicas(NAMESPACE, "qwen", parsed(replicas=2, kvCache={"min": "8Gi"}), "h1")
    short = plan_replicas(bigger, pods, capacity)
    assert [d.pod.name for d in short.deletes] == ["qwen-1"]
    # Within the request, a raised minimum is applied in place: nothing is replaced.
    within = parsed(replicas=2, staticMemory="17Gi", kvCache={"min": "5Gi"})
    assert (
        plan_replicas(desired_replicas(NAMESPACE, "qwen", within, "h1"), pods, capacity).deletes
        == ()
    )


def test_the_status_says_which_replicas_run_the_policy_and_events_say_when() -> None:
    pods = [pod(0), pod(1)]
    policies = {0: ReplicaPolicy("Applied"), 1: ReplicaPolicy("Pending", "runs an older kvCache")}
    applying = compute_status(
        Observation(generation=2, desired=2, pods=pods, plan=Plan(), kv_policy=policies), {}, NOW
    )
    placements = applying["placements"]
    assert [(p["pod"], p.get("kvPolicy")) for p in placements] == [
        ("qwen-0", "Applied"),
        ("qwen-1", "Pending"),
    ]
    progressing = {c["type"]: c for c in applying["conditions"]}["Progressing"]
    assert (progressing["status"], progressing["reason"]) == ("True", "ApplyingKVPolicy")
    assert (
        "1/2 replicas run the current kvCache in place; waiting for qwen-1"
        in progressing["message"]
    )

    done = compute_status(
        Observation(
            generation=2,
            desired=2,
            pods=pods,
            plan=Plan(),
            kv_policy={0: ReplicaPolicy("Applied"), 1: ReplicaPolicy("Applied")},
        ),
        applying,
        NOW,
    )
    (event,) = placement_events(placements, done["placements"])
    assert (event.type, event.reason) == ("Normal", "KVPolicyApplied")
    assert placement_events(done["placements"], done["placements"]) == []
    refused = [{**done["placements"][1], "kvPolicy": "Refused", "kvPolicyMessage": "no room"}]
    (warning,) = placement_events(done["placements"], refused)
    assert warning.reason == "KVPolicyRefused" and "qwen-1" in warning.message
