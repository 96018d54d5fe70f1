"""A ModelServer's status, computed from what was observed and planned: pure functions.

Conditions follow the Kubernetes conventions (``metav1.Condition``): a ``type``, a
``status`` of True/False/Unknown, a CamelCase ``reason``, a ``message`` for people, the
``observedGeneration`` it was computed from, and a ``lastTransitionTime`` that changes
only when ``status`` does. The four types:

- ``Placed``: every desired replica has a node and GPUs, and its pod was admitted (False
  says why not: no GPU fits, or a namespace quota refused it, ``QuotaExceeded``);
- ``Ready``: every desired replica answers its health check;
- ``Progressing``: replicas are being created, removed or replaced;
- ``Degraded``: something only a change of the spec or the cluster can fix, or replicas
  whose pods keep failing (``ReplicaFailing``, naming the pod and why it stopped);
- ``ResolvedRefs``: every ModelServer that ``colocateWith`` and ``avoidColocationWith``
  name exists (False names those that do not: placement ignores them until they do).

:func:`condition_events` turns condition changes into the Kubernetes Events a user sees
in ``kubectl describe``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvshare.api.kube import Condition
from kvshare.api.kvsharenode import PoolStatus
from kvshare.api.modelserver import KVUsage, Phase, ReplicaPlacement
from kvshare.operator.backoff import ReplicaFailure
from kvshare.operator.inplace import ReplicaPolicy
from kvshare.operator.plan import Plan
from kvshare.operator.views import PodView

__all__ = [
    "Event",
    "Observation",
    "Problem",
    "compute_status",
    "condition_events",
    "kv_usage",
    "placement_events",
    "with_problem",
]

CONDITION_TYPES = ("Placed", "Ready", "Progressing", "Degraded", "ResolvedRefs", "PriorityAllowed")
#: Most pod names listed in one message.
_MAX_NAMES = 5


@dataclass(frozen=True)
class Problem:
    """Why a ModelServer cannot be served as specified: a reason and what to do."""

    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event about a ModelServer."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Observation:
    """Everything one status is computed from."""

    generation: int
    desired: int
    pods: Sequence[PodView] = ()
    """This ModelServer's pods, including those just created."""
    plan: Plan | None = None
    problem: Problem | None = None
    """A problem with the spec itself; nothing is planned then."""
    quota: str | None = None
    """Why missing replicas wait for a namespace ResourceQuota (the last refusal)."""
    kv: KVUsage = field(default_factory=KVUsage)
    endpoint: str | None = None
    selector: str | None = None
    """The replica pods' label selector (for the scale subresource)."""
    failing: Sequence[ReplicaFailure] = ()
    """Replicas whose pods keep failing, by replica index."""
    kv_policy: Mapping[int, ReplicaPolicy] = field(default_factory=dict)
    """Whether each replica runs the current kvCache (see :mod:`.inplace`)."""
    namespace: str = ""
    missing_refs: Mapping[str, Sequence[str]] | None = field(default_factory=dict)
    """ModelServers named by a spec field that do not exist, by field (``None``: the spec
    could not be read)."""
    priority_capped: str | None = ""
    """Why its KV priority was capped to its namespace's ceiling ("": it was not;
    ``None``: the spec could not be read)."""


def kv_usage(pools: Sequence[PoolStatus]) -> KVUsage:
    """KV memory summed over a ModelServer's pools."""
    return KVUsage(
        min=sum(p.kv_min for p in pools),
        lease=sum(p.lease for p in pools),
        mapped=sum(p.mapped for p in pools),
        used=sum(p.used for p in pools),
        demand=sum(max(p.want, p.used) for p in pools),
    )


def _names(pods: Sequence[PodView]) -> str:
    shown = ", ".join(p.name for p in pods[:_MAX_NAMES])
    return shown + (f" and {len(pods) - _MAX_NAMES} more" if len(pods) > _MAX_NAMES else "")


def _placed(obs: Observation, serving: Sequence[PodView]) -> tuple[str, str, str]:
    plan = obs.plan
    if plan is None:  # the spec itself cannot be served
        problem = obs.problem or Problem("NotObserved", "")
        return "False", problem.reason, problem.message
    if plan.too_large:
        return "False", "ModelTooLarge", plan.too_large
    if plan.rollout and plan.rollout.waiting.startswith("cannot replace"):
        return "False", "Unschedulable", plan.rollout.waiting
    if obs.quota is not None:
        waiting = obs.desired - len(serving)
        return "False", "QuotaExceeded", f"{waiting} of {obs.desired} replicas wait: {obs.quota}"
    missing = {i: r for i, r in plan.unplaced.items() if i not in {p.replica for p in serving}}
    if missing:
        first = plan.unplaced[min(missing)]
        return (
            "False",
            "Unschedulable",
            f"{len(missing)} of {obs.desired} replicas cannot be placed: {first}",
        )
    nodes = {p.node for p in serving}
    if not obs.desired:
        return "True", "NoReplicas", "no replicas requested"
    return "True", "Placed", f"{obs.desired} replicas placed on {len(nodes)} node(s)"


def _ready(obs: Observation, serving: Sequence[PodView]) -> tuple[str, str, str]:
    ready = [p for p in serving if p.ready]
    if obs.problem is not None and not serving:
        return "False", "NotServing", "no replica runs (see Degraded)"
    if not obs.desired:
        return "True", "NoReplicas", "no replicas requested"
    if len(ready) >= obs.desired:
        return "True", "ReplicasReady", f"{len(ready)}/{obs.desired} replicas ready"
    waiting = [p for p in serving if not p.ready]
    detail = f"; not ready: {_names(waiting)}" if waiting else ""
    explained = [p for p in waiting if p.message][:_MAX_NAMES]
    detail += "".join(f"; {p.name}: {p.message}" for p in explained)
    return "False", "ReplicasNotReady", f"{len(ready)}/{obs.desired} replicas ready{detail}"


def _progressing(
    obs: Observation, serving: Sequence[PodView], was_rolling: bool
) -> tuple[str, str, str]:
    plan = obs.plan
    if plan is None:
        return "False", "SpecNotServable", "nothing changes until the spec is fixed"
    if plan.rollout is not None:
        rollout = plan.rollout
        waiting = f"; {rollout.waiting}" if rollout.waiting else ""
        return (
            "True",
            "RollingUpdate",
            f"{rollout.updated}/{rollout.desired} replicas run the current spec{waiting}",
        )
    if any(d.reason == "ScaledDown" for d in plan.deletes):
        return "True", "ScalingDown", f"removing replicas down to {obs.desired}"
    creating = [c.replica for c in plan.creates]
    starting = [p for p in serving if not p.ready and not p.finished]
    if was_rolling and (creating or starting):
        # Every replica runs the current spec; the rollout ends when the last one is ready.
        waiting = f"; waiting for {_names(starting)} to become ready" if starting else ""
        return (
            "True",
            "RollingUpdate",
            f"{len(serving)}/{obs.desired} replicas run the current spec{waiting}",
        )
    if creating:
        return "True", "CreatingReplicas", f"creating replica(s) {', '.join(map(str, creating))}"
    if starting:
        return "True", "ReplicasStarting", f"waiting for {_names(starting)} to become ready"
    pending = [
        p
        for p in serving
        if p.replica in obs.kv_policy and obs.kv_policy[p.replica].state == "Pending"
    ]
    if pending:
        applied = sum(s.state == "Applied" for s in obs.kv_policy.values())
        return (
            "True",
            "ApplyingKVPolicy",
            f"{applied}/{obs.desired} replicas run the current kvCache in place; waiting for "
            f"{_names(pending)}",
        )
    if obs.failing:
        return "False", "ReplicaFailing", "failed pods are replaced after a delay (see Degraded)"
    if obs.quota is not None:
        return "False", "WaitingForQuota", "replicas wait for namespace quota (see Placed)"
    if plan.unplaced:
        return "False", "WaitingForCapacity", "replicas wait for GPU capacity (see Placed)"
    return "False", "UpToDate", "all replicas run the current spec"


def _degraded(obs: Observation) -> tuple[str, str, str]:
    if obs.problem is not None:
        return "True", obs.problem.reason, obs.problem.message
    if obs.plan is not None and obs.plan.too_large:
        return "True", "ModelTooLarge", obs.plan.too_large
    if obs.failing:
        first, *others = obs.failing
        more = f"; also failing: {', '.join(f.pod for f in others)}" if others else ""
        return "True", "ReplicaFailing", first.describe() + more
    return "False", "AsExpected", ""


def _resolved_refs(obs: Observation) -> tuple[str, str, str]:
    if obs.missing_refs is None:
        return "Unknown", "SpecNotServable", "the spec cannot be read (see Degraded)"
    if not obs.missing_refs:
        return "True", "ResolvedRefs", "every ModelServer the colocation rules name exists"
    named = "; ".join(
        f"{field} names {', '.join(names)}" for field, names in obs.missing_refs.items()
    )
    return (
        "False",
        "ModelServerNotFound",
        f"{named}: no ModelServer of that name in namespace {obs.namespace} (placement "
        "ignores the names until they exist)",
    )


def _priority_allowed(obs: Observation) -> tuple[str, str, str]:
    if obs.priority_capped is None:
        return "Unknown", "SpecNotServable", "the spec cannot be read (see Degraded)"
    if obs.priority_capped:
        return "False", "PriorityCapped", obs.priority_capped
    return "True", "WithinCeiling", "kvCache.priority is within what the namespace may use"


def _conditions(
    previous: Sequence[Mapping[str, Any]],
    values: Mapping[str, tuple[str, str, str]],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous}
    conditions = []
    for kind in CONDITION_TYPES:
        status, reason, message = values[kind]
        old = before.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        conditions.append(
            Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since or now,
                observed_generation=generation,
            ).to_wire()
        )
    return conditions


def _phase(conditions: Mapping[str, str], obs: Observation, serving: Sequence[PodView]) -> Phase:
    if conditions["Degraded"] == "True":
        return "Degraded"
    if conditions["Placed"] == "False":
        return "Unschedulable"
    if conditions["Ready"] == "True":
        return "Ready"
    return "Starting" if serving else "Pending"


def _placement(pod: PodView, policy: ReplicaPolicy | None) -> dict[str, Any]:
    return ReplicaPlacement(
        replica=pod.replica,
        pod=pod.name,
        node=pod.node,
        gpus=list(pod.gpus),
        kv_policy=policy.state if policy else None,
        kv_policy_message=(policy.message[:512] or None) if policy else None,
    ).to_wire()


def compute_status(obs: Observation, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status to write, as stored (camelCase, quantities as strings).

    ``previous`` is the status now stored; conditions whose status did not change keep
    their ``lastTransitionTime``.
    """
    serving = sorted(
        (p for p in obs.pods if p.replica < obs.desired and not p.terminating),
        key=lambda p: p.replica,
    )
    was_rolling = any(
        c.get("type") == "Progressing" and c.get("reason") == "RollingUpdate"
        for c in previous.get("conditions") or ()
    )
    values = {
        "Placed": _placed(obs, serving),
        "Ready": _ready(obs, serving),
        "Progressing": _progressing(obs, serving, was_rolling),
        "Degraded": _degraded(obs),
        "ResolvedRefs": _resolved_refs(obs),
        "PriorityAllowed": _priority_allowed(obs),
    }
    conditions = _conditions(previous.get("conditions") or [], values, obs.generation, now)
    ready = sum(p.ready for p in serving)
    status: dict[str, Any] = {
        "phase": _phase({k: v[0] for k, v in values.items()}, obs, serving),
        "observedGeneration": obs.generation,
        "replicas": len(serving),
        "readyReplicas": ready,
        "ready": f"{ready}/{obs.desired}",
        "conditions": conditions,
        "placements": [_placement(p, obs.kv_policy.get(p.replica)) for p in serving],
        "kv": obs.kv.to_wire(),
    }
    if obs.endpoint is not None:
        status["endpoint"] = obs.endpoint
    if obs.selector is not None:
        status["selector"] = obs.selector
    return status


def with_problem(
    previous: Mapping[str, Any], problem: Problem, generation: int, now: str
) -> dict[str, Any]:
    """``previous`` with ``Degraded`` set to ``problem`` (when reconciling itself fails)."""
    status = dict(previous)
    values = {
        c["type"]: (c["status"], c["reason"], c.get("message", ""))
        for c in previous.get("conditions") or ()
        if c.get("type") in CONDITION_TYPES
    }
    for kind in CONDITION_TYPES:
        values.setdefault(kind, ("Unknown", "NotObserved", ""))
    values["Degraded"] = ("True", problem.reason, problem.message)
    status["conditions"] = _conditions(previous.get("conditions") or [], values, generation, now)
    status["phase"] = "Degraded"
    return status


def condition_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[Event]:
    """Events for condition changes a user would ask about.

    A placement failure, a degradation or a missing ModelServer is reported when its
    reason or message changes (so an unchanged problem is not repeated on every
    reconcile); becoming ready once.
    """
    bad = {
        "Placed": "False",
        "Degraded": "True",
        "ResolvedRefs": "False",
        "PriorityAllowed": "False",
    }
    before = {c.get("type"): c for c in previous}
    now = {c.get("type"): c for c in current}
    events = []
    for condition in current:
        kind = condition["type"]
        old = before.get(kind, {})
        changed = (old.get("status"), old.get("reason"), old.get("message")) != (
            condition["status"],
            condition["reason"],
            condition.get("message", ""),
        )
        if not changed:
            continue
        if condition["status"] == bad.get(kind):
            if kind == "Placed" and condition["reason"] == now.get("Degraded", {}).get("reason"):
                continue  # the same finding is reported once, as Degraded
            events.append(Event("Warning", condition["reason"], condition.get("message", "")))
        elif kind == "Ready" and condition["status"] == "True" and old.get("status") != "True":
            events.append(Event("Normal", "Ready", condition.get("message", "")))
    return events


def placement_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[Event]:
    """Events for the KV policy changed in place: a replica whose node refused it (once per
    refusal), and every replica running it (once, when the last one takes it)."""
    before = {p.get("pod"): p.get("kvPolicy") for p in previous}
    events = [
        Event(
            "Warning",
            "KVPolicyRefused",
            f"replica {p['replica']} (pod {p['pod']}): {p.get('kvPolicyMessage', '')}; "
            "replacing it",
        )
        for p in current
        if p.get("kvPolicy") == "Refused" and before.get(p["pod"]) != "Refused"
    ]
    states = [p.get("kvPolicy") for p in current]
    if (
        states
        and all(s == "Applied" for s in states)
        and any(before.get(p["pod"]) in ("Pending", "Refused") for p in current)
    ):
        events.append(
            Event("Normal", "KVPolicyApplied", f"{len(states)} replica(s) run the current kvCache")
        )
    return events
