"""KV policies changed in place: a pod's policy applied to the pools of that pod by the
broker, with no restart.

The cluster side (:mod:`kvshare.deviceplugin.cluster.pod_policies`) reads each pod's
``kvshare.io/kv-policy`` annotation into a :class:`PodPolicy` and hands it to the broker
(:meth:`~kvshare.deviceplugin.broker.server.Broker.set_pod_policy`); the broker applies it
to the pod's pools (:func:`apply`), now and to every pool the pod opens later (an engine
restarting in the same pod, a pool re-declaring after a broker restart). A pool is the
pod's when its hello names the pod's uid, which the broker checks against the process's
cgroup.

A minimum is refused beyond what the pod's ``kvshare.io/gpu-memory`` request covers per
GPU, so that an annotation cannot make the broker guarantee memory the scheduler and the
namespace's quota never accounted. A refusal changes nothing: the pool keeps the policy
it runs, and the KVShareNode says which it runs (:class:`PolicyState`) and why the other
was refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.api import kvpolicy, names
from kvshare.api.quantity import format_bytes
from kvshare.deviceplugin.broker.books import Books, PoolRecord, Send

__all__ = ["PodPolicies", "PodPolicy", "PolicyState", "apply"]


@dataclass(frozen=True)
class PodPolicy:
    """What a pod's annotation asks of its pools (or why it cannot be read)."""

    revision: str = ""
    kv_min: int = 0
    kv_max: int | None = None
    priority: int = 100
    per_gpu_bytes: int | None = None
    """GPU memory per GPU the pod's ``kvshare.io/gpu-memory`` request covers (None: it
    requests none, so nothing bounds the minimum but the GPU)."""
    error: str = ""
    """Why the annotation is not a policy (then nothing else is set)."""


@dataclass(frozen=True)
class PolicyState:
    """The policy a pool runs under, and the pod's policy it could not take, if any."""

    policy: str
    """Revision in force."""
    refused: str = ""
    message: str = ""


def _declared(record: PoolRecord) -> PolicyState:
    """The state of a pool just admitted: the policy its hello declared."""
    hello = record.hello
    return PolicyState(kvpolicy.revision(hello.kv_min, hello.kv_max, hello.priority))


def apply(
    books: Books, record: PoolRecord, policy: PodPolicy, state: PolicyState, now: float
) -> tuple[list[Send], PolicyState]:
    """Apply ``policy`` to pool ``record`` (whose state is ``state``): the messages to send
    and the pool's new state. Called under the broker's lock."""
    if policy.error:
        return [], PolicyState(state.policy, message=policy.error)
    if policy.revision == state.policy:
        return [], PolicyState(state.policy)  # what it runs; an older refusal is moot
    bound = policy.per_gpu_bytes
    if bound is not None and record.static + policy.kv_min > bound:
        message = (
            f"kvCache.min {format_bytes(policy.kv_min)} and the static "
            f"{format_bytes(record.static)} exceed the "
            f"{format_bytes(bound)} per GPU the pod's {names.RESOURCE_GPU_MEMORY} "
            "request covers: a replacement pod must request it"
        )
        return [], PolicyState(state.policy, policy.revision, message)
    try:
        sends = books.set_policy(record.id, policy.kv_min, policy.kv_max, policy.priority, now)
    except ValueError as exc:
        return [], PolicyState(state.policy, policy.revision, str(exc))
    return sends, PolicyState(policy.revision)


class PodPolicies:
    """The broker's table of annotated policies (by pod uid) and of each pool's state.

    Not thread-safe: the broker calls it under its lock (``Broker._lock``), and applies
    changes on its own thread, so that the messages they make are sent from there.
    """

    def __init__(self) -> None:
        self._wanted: dict[str, PodPolicy] = {}
        self._changed: set[str] = set()
        self._states: dict[int, PolicyState] = {}

    def set(self, pod_uid: str, policy: PodPolicy | None) -> bool:
        """Record what pod ``pod_uid`` asks for (``None``: it is gone, its pools keep
        what they run); True when its pools have something new to apply."""
        if policy is None:
            self._wanted.pop(pod_uid, None)
            return False
        if not pod_uid or self._wanted.get(pod_uid) == policy:
            return False
        self._wanted[pod_uid] = policy
        self._changed.add(pod_uid)
        return True

    def admitted(self, books: Books, record: PoolRecord, now: float) -> list[Send]:
        """A pool was admitted (or re-declared): its pod's policy applies to it too."""
        self._states[record.id] = _declared(record)
        return self._apply_to(books, record, now)

    def apply_changed(self, books: Books, now: float) -> tuple[list[Send], list[PoolRecord]]:
        """Apply the pods' new policies to their pools: the messages, and the pools whose
        minimum may have moved."""
        sends: list[Send] = []
        touched = []
        changed, self._changed = self._changed, set()
        for record in books.pools():
            if record.hello.pod_uid in changed:
                sends += self._apply_to(books, record, now)
                touched.append(record)
        return sends, touched

    def forget_pool(self, pool_id: int) -> None:
        self._states.pop(pool_id, None)

    def states(self) -> dict[int, PolicyState]:
        """Pool id -> the policy it runs under."""
        return dict(self._states)

    def _apply_to(self, books: Books, record: PoolRecord, now: float) -> list[Send]:
        policy = self._wanted.get(record.hello.pod_uid) if record.hello.pod_uid else None
        if policy is None:
            return []
        state = self._states.get(record.id) or _declared(record)
        sends, self._states[record.id] = apply(books, record, policy, state, now)
        return sends
