"""A ModelServer's KV policy changed in place: pure functions.

``kvCache`` (``min``, ``max``, ``priority``) is not part of a replica's template: a change
travels to the running replicas through their pods' ``kvshare.io/kv-policy`` annotation
(:func:`pods_to_annotate`), which the node agent applies to their pools, and the
KVShareNodes report which policy each pool runs under. :func:`replica_policies` reads
that back per replica:

- ``Applied``: every pool of the replica runs the ModelServer's current policy;
- ``Pending``: its pools run an older one (the agent has not seen the annotation yet, or
  has not published since);
- ``Refused``: its node could not apply it in place (a raised ``min`` its GPU cannot
  guarantee, or one its pod's GPU-memory request does not cover): the replica is then
  replaced, through the rolling rules, by a pod placed where it fits.

A replica whose pools are not reported yet (its engine is starting) has no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvshare.api import kvpolicy
from kvshare.api.kvsharenode import PoolStatus
from kvshare.api.modelserver import KVCacheSpec
from kvshare.operator.views import PodView

__all__ = [
    "ReplicaPolicy",
    "WantedPolicy",
    "pods_to_annotate",
    "refused_replicas",
    "replica_policies",
    "wanted_policy",
]

PolicyState = Literal["Applied", "Pending", "Refused"]


@dataclass(frozen=True)
class WantedPolicy:
    """The policy a ModelServer's replicas should run under."""

    annotation: str
    """The pods' ``kvshare.io/kv-policy`` value."""
    revision: str
    description: str


@dataclass(frozen=True)
class ReplicaPolicy:
    """Whether one replica runs the current policy."""

    state: PolicyState
    message: str = ""


def wanted_policy(kv_cache: KVCacheSpec) -> WantedPolicy:
    return WantedPolicy(
        annotation=kvpolicy.encode(kv_cache),
        revision=kvpolicy.revision(kv_cache.min, kv_cache.max, kv_cache.priority),
        description=kvpolicy.describe(kv_cache),
    )


def pods_to_annotate(pods: Iterable[PodView], wanted: WantedPolicy) -> list[PodView]:
    """Live pods whose annotation is not the wanted policy (a hand edit is put back too)."""
    return [
        p for p in pods if not p.terminating and not p.finished and p.kv_policy != wanted.annotation
    ]


def replica_policies(
    pods: Sequence[PodView], pools: Iterable[PoolStatus], wanted: WantedPolicy
) -> dict[int, ReplicaPolicy]:
    """Replica -> whether it runs ``wanted``, from its pods' pools (see the module doc)."""
    by_pod: dict[tuple[str, str], list[PoolStatus]] = {}
    for pool in pools:
        by_pod.setdefault((pool.namespace, pool.pod), []).append(pool)
    states = {}
    for pod in pods:
        mine = by_pod.get((pod.namespace, pod.name))
        if not mine or pod.terminating:
            continue
        refused = [p for p in mine if p.policy_refused == wanted.revision]
        if refused:
            states[pod.replica] = ReplicaPolicy("Refused", refused[0].policy_message)
        elif all(p.policy == wanted.revision for p in mine):
            states[pod.replica] = ReplicaPolicy("Applied")
        else:
            states[pod.replica] = ReplicaPolicy(
                "Pending", f"runs an older kvCache; applying {wanted.description}"
            )
    return states


def refused_replicas(states: Mapping[int, ReplicaPolicy]) -> frozenset[int]:
    """Replicas to replace: their node could not apply the policy in place."""
    return frozenset(i for i, s in states.items() if s.state == "Refused")
