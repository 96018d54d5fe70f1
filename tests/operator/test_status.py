"""Status: phase, conditions in Kubernetes conventions, KV usage, and the Events that
condition changes produce."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvshare.api.kvsharenode import PoolStatus
from kvshare.api.placement import Placement
from kvshare.operator.backoff import ReplicaFailure
from kvshare.operator.plan import Create, Plan, Rollout
from kvshare.operator.status import (
    Event,
    Observation,
    Problem,
    compute_status,
    condition_events,
    kv_usage,
    with_problem,
)
from tests.operator.specs import GIB, pod

T0, T1 = "2030-01-01T00:00:00Z", "2030-01-01T00:05:00Z"


def status(
    obs: Observation, previous: dict[str, Any] | None = None, now: str = T0
) -> dict[str, Any]:
    return compute_status(obs, previous or {}, now)


def conditions(result: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


def test_all_replicas_ready_is_phase_ready_with_every_condition_set() -> None:
    pods = [pod(0, gpus=("GPU-a0", "GPU-a1")), pod(1, node="node-b", gpus=("GPU-b0", "GPU-b1"))]
    result = status(
        Observation(generation=3, desired=2, pods=pods, plan=Plan(), endpoint="http://x")
    )
    assert result["phase"] == "Ready"
    assert result["ready"] == "2/2"
    assert (result["replicas"], result["readyReplicas"], result["observedGeneration"]) == (2, 2, 3)
    assert conditions(result) == {
        "Placed": ("True", "Placed"),
        "Ready": ("True", "ReplicasReady"),
        "Progressing": ("False", "UpToDate"),
        "Degraded": ("False", "AsExpected"),
        "ResolvedRefs": ("True", "ResolvedRefs"),
        "PriorityAllowed": ("True", "WithinCeiling"),
    }
    assert all(
        c["observedGeneration"] == 3 and c["lastTransitionTime"] == T0 for c in result["conditions"]
    )
    assert result["placements"] == [
        {"replica": 0, "pod": "qwen-0", "node": "node-a", "gpus": ["GPU-a0", "GPU-a1"]},
        {"replica": 1, "pod": "qwen-1", "node": "node-b", "gpus": ["GPU-b0", "GPU-b1"]},
    ]
    assert result["endpoint"] == "http://x"


def test_transition_time_moves_only_when_a_condition_changes_status() -> None:
    starting = Observation(generation=1, desired=1, pods=[pod(0, ready=False)], plan=Plan())
    first = status(starting, now=T0)
    assert first["phase"] == "Starting"
    again = status(starting, first, now=T1)
    assert again == first  # nothing changed: nothing to write
    ready = status(Observation(generation=2, desired=1, pods=[pod(0)], plan=Plan()), first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Placed": T0, "Ready": T1, "Progressing": T1, "Degraded": T0,
                     "ResolvedRefs": T0, "PriorityAllowed": T0}  # fmt: skip
    assert {c["observedGeneration"] for c in ready["conditions"]} == {2}


def test_unplaced_replicas_make_the_phase_unschedulable_with_the_reason() -> None:
    reason = "no node has 2 GPUs with 38Gi free and a free slot (largest: 31Gi on gpu-node-3)"
    obs = Observation(
        generation=1, desired=3, pods=[pod(0)], plan=Plan(unplaced={1: reason, 2: reason})
    )
    result = status(obs)
    assert result["phase"] == "Unschedulable"
    placed = next(c for c in result["conditions"] if c["type"] == "Placed")
    assert (placed["status"], placed["reason"]) == ("False", "Unschedulable")
    assert placed["message"] == f"2 of 3 replicas cannot be placed: {reason}"
    assert conditions(result)["Progressing"] == ("False", "WaitingForCapacity")


def test_a_spec_problem_is_degraded_and_not_placed() -> None:
    problem = Problem("UnsupportedEngineVersion", "vllm 0.20.1 is not supported")
    result = status(Observation(generation=1, desired=2, problem=problem))
    assert result["phase"] == "Degraded"
    assert conditions(result)["Degraded"] == ("True", "UnsupportedEngineVersion")
    assert conditions(result)["Placed"] == ("False", "UnsupportedEngineVersion")
    assert result["replicas"] == 0


def test_a_model_too_large_for_any_gpu_is_degraded() -> None:
    plan = Plan(unplaced={0: "too big"}, too_large="each worker needs 90Gi ...")
    result = status(Observation(generation=1, desired=1, plan=plan))
    assert result["phase"] == "Degraded"
    assert conditions(result)["Placed"] == ("False", "ModelTooLarge")
    assert conditions(result)["Degraded"] == ("True", "ModelTooLarge")


def test_progressing_says_what_is_changing() -> None:
    rolling = Plan(
        rollout=Rollout(updated=1, desired=3, waiting="waiting for qwen-2 to become ready")
    )
    result = status(
        Observation(generation=2, desired=3, pods=[pod(i) for i in range(3)], plan=rolling)
    )
    progressing = next(c for c in result["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "True"
    assert progressing["message"] == (
        "1/3 replicas run the current spec; waiting for qwen-2 to become ready"
    )
    creating = Plan(creates=(Create(1, Placement("node-a", ("GPU-a0",))),))
    result = status(Observation(generation=2, desired=2, pods=[pod(0)], plan=creating))
    assert conditions(result)["Progressing"] == ("True", "CreatingReplicas")


def test_kv_usage_sums_the_pools() -> None:
    pools = [
        PoolStatus(
            namespace="llm",
            pod="qwen-0",
            kv_min=4 * GIB,
            lease=10 * GIB,
            mapped=8 * GIB,
            used=6 * GIB,
            want=10 * GIB,
        ),
        PoolStatus(
            namespace="llm", pod="qwen-1", kv_min=4 * GIB, lease=2 * GIB, mapped=2 * GIB, used=GIB
        ),
    ]
    usage = kv_usage(pools)
    assert usage.to_wire() == {
        "min": "8Gi",
        "lease": "12Gi",
        "mapped": "10Gi",
        "used": "7Gi",
        # What each asks for or holds in live blocks, whichever is more.
        "demand": "11Gi",
    }
    result = status(Observation(generation=1, desired=0, plan=Plan(), kv=usage))
    assert result["kv"]["used"] == "7Gi"


def test_events_report_a_problem_once_and_again_when_it_changes() -> None:
    reason = "no node has 1 GPU with 30Gi free and a free slot (largest: 20Gi on node-a)"
    waiting = Observation(generation=1, desired=1, plan=Plan(unplaced={0: reason}))
    first = status(waiting)
    (event,) = condition_events([], first["conditions"])
    assert event == Event("Warning", "Unschedulable", f"1 of 1 replicas cannot be placed: {reason}")
    assert condition_events(first["conditions"], status(waiting, first)["conditions"]) == []
    other = Observation(
        generation=1, desired=1, plan=Plan(unplaced={0: reason.replace("20", "25")})
    )
    assert len(condition_events(first["conditions"], status(other, first)["conditions"])) == 1
    ready = status(Observation(generation=1, desired=1, pods=[pod(0)], plan=Plan()), first)
    assert condition_events(first["conditions"], ready["conditions"]) == [
        Event("Normal", "Ready", "1/1 replicas ready")
    ]


def test_a_spec_problem_is_one_event_not_two() -> None:
    problem = Problem("InvalidSpec", "kvCache: kvCache.min (50Gi) exceeds kvCache.max (40Gi)")
    result = status(Observation(generation=1, desired=0, problem=problem))
    assert condition_events([], result["conditions"]) == [
        Event("Warning", "InvalidSpec", problem.message)
    ]


def test_a_failed_reconcile_marks_only_degraded() -> None:
    ready = status(Observation(generation=1, desired=1, pods=[pod(0)], plan=Plan()))
    failed = with_problem(ready, Problem("ReconcileError", "500 boom"), 1, T1)
    assert failed["phase"] == "Degraded"
    assert conditions(failed)["Ready"] == ("True", "ReplicasReady")
    degraded = next(c for c in failed["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["message"], degraded["lastTransitionTime"]) == (
        "True", "500 boom", T1,
    )  # fmt: skip
    assert failed["placements"] == ready["placements"]


def test_not_ready_replicas_say_what_the_scheduler_or_kubelet_said() -> None:
    stuck = replace(pod(1, ready=False, phase="Pending"),
                    message="0/3 nodes are available: 3 Insufficient kvshare.io/gpu.")  # fmt: skip
    result = status(Observation(generation=1, desired=2, pods=[pod(0), stuck], plan=Plan()))
    ready = next(c for c in result["conditions"] if c["type"] == "Ready")
    assert ready["message"] == (
        "1/2 replicas ready; not ready: qwen-1; "
        "qwen-1: 0/3 nodes are available: 3 Insufficient kvshare.io/gpu."
    )


def test_failing_replicas_are_degraded_with_the_pod_and_why_and_clear_when_ready() -> None:
    failed = replace(pod(0, ready=False, phase="Failed"), message="Evicted: low on memory")
    failing = (
        ReplicaFailure(0, "qwen-0", "UnexpectedAdmissionError: Allocate failed", 3, 40),
        ReplicaFailure(2, "qwen-2", "container engine: Error, exit code 1"),
    )
    obs = Observation(
        generation=1, desired=3, pods=[failed, pod(1), pod(2)], plan=Plan(), failing=failing
    )
    result = status(obs)
    assert result["phase"] == "Degraded"
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReplicaFailing")
    assert degraded["message"] == (
        "pod qwen-0 failed 3 times in a row (UnexpectedAdmissionError: Allocate failed); "
        "replica 0 is replaced 40s after its last failure; also failing: qwen-2"
    )
    # The failed pod waits for its delay: nothing progresses meanwhile.
    assert conditions(result)["Progressing"] == ("False", "ReplicaFailing")
    (event,) = condition_events([], result["conditions"])
    assert event == Event("Warning", "ReplicaFailing", degraded["message"])
    # The same failure on the next reconcile: no new Event.
    assert condition_events(result["conditions"], status(obs, result)["conditions"]) == []
    recovered = status(
        Observation(generation=1, desired=3, pods=[pod(0), pod(1), pod(2)], plan=Plan()), result
    )
    assert recovered["phase"] == "Ready"
    assert conditions(recovered)["Degraded"] == ("False", "AsExpected")


def test_colocation_rules_naming_missing_modelservers_are_a_condition_and_a_warning() -> None:
    missing = {"colocateWith": ["llama"], "avoidColocationWith": ["a", "b"]}
    obs = Observation(generation=1, desired=1, plan=Plan(), namespace="llm", missing_refs=missing)
    result = status(obs)
    assert conditions(result)["ResolvedRefs"] == ("False", "ModelServerNotFound")
    assert result["phase"] != "Degraded"  # a preference that cannot apply yet, not a fault
    (event,) = [e for e in condition_events([], result["conditions"]) if e.type == "Warning"]
    assert event.reason == "ModelServerNotFound"
    assert event.message == (
        "colocateWith names llama; avoidColocationWith names a, b: no ModelServer of that "
        "name in namespace llm (placement ignores the names until they exist)"
    )
    unreadable = status(
        replace(obs, plan=None, problem=Problem("InvalidSpec", "x"), missing_refs=None)
    )
    assert conditions(unreadable)["ResolvedRefs"] == ("Unknown", "SpecNotServable")
