"""What to do next for one ModelServer's replicas: a pure function of desired and observed.

:func:`plan_replicas` compares the replicas a ModelServer asks for with the pods that
exist and returns the pods to create (with their placement), the pods to delete, and
the replicas that cannot be placed, with the reason. Rules:

- Replica ``i`` is pod ``<name>-<i>``: one pod per index, so a restarted operator finds
  every replica by name and never makes a second one.
- Scale down removes the highest indexes first; scale up creates every missing index.
- A pod that finished (Failed, e.g. evicted, or Succeeded) is deleted and made again,
  unless its replica is held back after failing (see :mod:`.backoff`): then it stays.
- A spec change rolls one replica at a time: an outdated pod (another template hash, a
  GPU-memory request that no longer covers ``kvCache.min``, or a KV policy its node
  refused to apply in place) is replaced only when no replacement is in flight (nothing
  terminating, every updated pod ready). Unready outdated pods go first (replacing them
  costs no availability); a ready one is replaced only when every other replica is
  ready, highest index first. A replacement is started only if the new spec can be
  placed once the old pod is gone.
- A replica is created where :func:`kvshare.api.placement.place` puts it, given every
  other replica's current placement; the pod keeps that placement for its lifetime.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvshare.api.modelserver import ModelServerSpec
from kvshare.api.placement import Placement, ReplicaRequest, Tolerance, Unplaced, place
from kvshare.operator.capacity import Capacity, group_of, replica_key
from kvshare.operator.views import PodView

__all__ = [
    "Create",
    "Delete",
    "Desired",
    "Plan",
    "Rollout",
    "desired_replicas",
    "plan_replicas",
    "pod_name",
]

DeleteReason = Literal["ScaledDown", "RollingUpdate", "Replaced"]


def pod_name(modelserver: str, replica: int) -> str:
    """The name of replica ``replica``'s pod: stable, so reconciles are idempotent."""
    return f"{modelserver}-{replica}"


@dataclass(frozen=True)
class Desired:
    """What a ModelServer asks for, in the terms placement and planning use."""

    namespace: str
    name: str
    replicas: int
    template_hash: str
    per_gpu_bytes: int
    tp: int
    gpu_memory_units: int = 0
    """The ``kvshare.io/gpu-memory`` request a replica needs (a pod's cannot change)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Tolerance, ...] = ()
    colocate_with: frozenset[str] = frozenset()
    avoid: frozenset[str] = frozenset()
    policy: Literal["binpack", "spread"] = "binpack"

    def runs(self, pod: PodView, refused: Collection[int] = ()) -> bool:
        """Whether ``pod`` runs what this asks for: the same template, a request that covers
        the GPU memory it needs, and no KV policy its node refused to apply in place."""
        return (
            pod.template_hash == self.template_hash
            and pod.gpu_memory_units >= self.gpu_memory_units
            and pod.replica not in refused
        )

    def request(self, replica: int) -> ReplicaRequest:
        """The placement request of replica ``replica`` (not yet placed)."""
        return ReplicaRequest(
            key=replica_key(self.namespace, pod_name(self.name, replica)),
            group=group_of(self.namespace, self.name),
            per_gpu_bytes=self.per_gpu_bytes,
            tp=self.tp,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            colocate_with=self.colocate_with,
            avoid=self.avoid,
            policy=self.policy,
        )


def desired_replicas(
    namespace: str, name: str, spec: ModelServerSpec, template_hash: str
) -> Desired:
    """:class:`Desired` of a validated spec."""
    return Desired(
        namespace=namespace,
        name=name,
        replicas=spec.replicas,
        template_hash=template_hash,
        per_gpu_bytes=spec.static_bytes_per_worker() + spec.kv_cache.min,
        tp=spec.tensor_parallel_size,
        gpu_memory_units=spec.gpu_memory_units_per_replica(),
        node_selector=spec.node_selector,
        tolerations=tuple(
            Tolerance(
                key=t.key or "", operator=t.operator, value=t.value or "", effect=t.effect or ""
            )
            for t in spec.tolerations
        ),
        colocate_with=frozenset(group_of(namespace, n) for n in spec.colocate_with),
        avoid=frozenset(group_of(namespace, n) for n in spec.avoid_colocation_with),
        policy="spread" if spec.placement_policy == "Spread" else "binpack",
    )


@dataclass(frozen=True)
class Create:
    """Create replica ``replica``'s pod at ``placement``."""

    replica: int
    placement: Placement


@dataclass(frozen=True)
class Delete:
    """Delete ``pod``: scaled away, replaced by a newer spec, or finished."""

    pod: PodView
    reason: DeleteReason


@dataclass(frozen=True)
class Rollout:
    """Progress of a spec change across the replicas."""

    updated: int
    """Replicas running the current spec."""
    desired: int
    waiting: str = ""
    """What the rollout waits for, when it waits."""


@dataclass(frozen=True)
class Plan:
    """The next steps for one ModelServer."""

    creates: tuple[Create, ...] = ()
    deletes: tuple[Delete, ...] = ()
    unplaced: Mapping[int, str] = field(default_factory=dict)
    """Replicas that cannot be placed (or replaced), with the reason."""
    too_large: str | None = None
    """Why no GPU of the cluster could ever hold a replica; nothing is created then."""
    rollout: Rollout | None = None
    """Set while some replica runs an older spec."""


def _outdated_to_replace(
    desired: Desired, by_index: Mapping[int, PodView], refused: Collection[int]
) -> tuple[PodView | None, str]:
    """The outdated pod to replace now, or why none is (empty when nothing is outdated)."""
    wanted = range(desired.replicas)
    pods = [by_index[i] for i in wanted if i in by_index]
    outdated = [
        p for p in pods if not desired.runs(p, refused) and not (p.terminating or p.finished)
    ]
    if not outdated:
        return None, ""
    terminating = [p.name for p in pods if p.terminating]
    if terminating:
        return None, f"waiting for {', '.join(terminating)} to stop"
    starting = [p.name for p in pods if desired.runs(p, refused) and not p.ready and not p.finished]
    if starting:
        return None, f"waiting for {', '.join(starting)} to become ready"
    unready = [p for p in outdated if not p.ready]
    if unready:
        return max(unready, key=lambda p: p.replica), ""
    unavailable = [i for i in wanted if i not in by_index or not by_index[i].ready]
    if unavailable:
        return (
            None,
            f"waiting for {len(unavailable)} unavailable replica(s) before replacing a ready one",
        )
    return max(outdated, key=lambda p: p.replica), ""


def plan_replicas(
    desired: Desired,
    pods: Iterable[PodView],
    capacity: Callable[[], Capacity],
    held: Collection[int] = (),
    refused: Collection[int] = (),
) -> Plan:
    """The next steps for ``desired`` given its existing ``pods``.

    ``capacity`` is called only when something must be placed; it returns the cluster's
    capacity with every known pod, these ``pods`` included, as current placements.
    The finished pods of the ``held`` replicas are kept, not replaced yet; the pods of the
    ``refused`` replicas (their node could not apply the KV policy in place) are outdated.
    """
    by_index: dict[int, PodView] = {}
    for pod in sorted(pods, key=lambda p: (p.terminating, p.name)):
        by_index.setdefault(pod.replica, pod)

    deletes: list[Delete] = []
    for index in sorted(by_index, reverse=True):
        pod = by_index[index]
        if pod.terminating:
            continue
        if index >= desired.replicas:
            deletes.append(Delete(pod, "ScaledDown"))
        elif pod.finished and index not in held:
            deletes.append(Delete(pod, "Replaced"))

    missing = [i for i in range(desired.replicas) if i not in by_index]
    replace, waiting = _outdated_to_replace(desired, by_index, refused)
    pending = [*missing, *([replace.replica] if replace else [])]

    unplaced: dict[int, str] = {}
    creates: list[Create] = []
    too_large = None
    if pending:
        cluster = capacity()
        too_large = cluster.too_small_for(desired.per_gpu_bytes, desired.tp)
        if too_large:
            unplaced = dict.fromkeys(pending, too_large)
        else:
            current = dict(cluster.current)
            if replace is not None:
                # The replacement may use what the pod it replaces frees.
                current.pop(replica_key(replace.namespace, replace.name), None)
            requests = {i: desired.request(i) for i in pending}
            result = place([*current.values(), *requests.values()], cluster.nodes)
            for index, request in requests.items():
                outcome = result[request.key]
                if isinstance(outcome, Unplaced):
                    unplaced[index] = outcome.reason
                elif index in missing:
                    creates.append(Create(index, outcome))
        if replace is not None:
            if replace.replica in unplaced:
                waiting = f"cannot replace {replace.name}: {unplaced[replace.replica]}"
            else:
                deletes.append(Delete(replace, "RollingUpdate"))

    rollout = None
    live = [p for i, p in by_index.items() if i < desired.replicas and not p.terminating]
    if not all(desired.runs(p, refused) for p in live):
        updated = sum(desired.runs(p, refused) for p in live)
        rollout = Rollout(updated=updated, desired=desired.replicas, waiting=waiting)
    return Plan(
        creates=tuple(creates),
        deletes=tuple(deletes),
        unplaced=unplaced,
        too_large=too_large,
        rollout=rollout,
    )
