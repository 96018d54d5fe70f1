"""Back-off for replicas whose pods keep failing, so a broken spec is not retried in a loop.

A replica pod ends up ``Failed`` (the operator's pods restart their containers themselves,
so this is a pod the node refused or gave up on: the device plugin refused its GPUs at
admission, the kubelet evicted it, the node shut down) and the operator must replace it.
Replacing it at once, every time, would turn a cause that persists into a tight
create/fail/delete loop. :class:`FailureBackoff` counts each replica's consecutive
failures and keeps its failed pod (so ``kubectl describe`` and ``logs`` still show why)
until a delay has passed: ``initial`` seconds after the first failure, doubling with
each further one up to ``maximum``. Once a replica has been ready for ``reset_after``
seconds, its count starts over. A pod of an older spec is replaced at once: the change
may be the fix.

It also reports the replicas that are failing now, for the ``Degraded`` condition: those
with a failed pod, those retried after one and not ready yet, and those whose container
the kubelet restarts again and again (``CrashLoopBackOff``; the kubelet backs off itself).

The counts live in the operator's memory: a restarted operator starts them over. All
access happens on the event loop's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the operator's command line reads BackoffPolicy before any heavy import
    from kvshare.operator.views import ModelServerKey, PodView

__all__ = ["BackoffPolicy", "FailureBackoff", "ReplicaFailure", "ReplicaFailures"]


@dataclass(frozen=True)
class BackoffPolicy:
    """How long a failed replica waits before its pod is replaced."""

    initial: float = 10.0
    """Seconds after the first failure."""
    maximum: float = 300.0
    """Cap on the delay, however many failures in a row."""
    reset_after: float = 600.0
    """Seconds a replica must stay ready before its failures are forgotten."""

    def delay(self, failures: int) -> float:
        """Seconds to wait after failure number ``failures`` (1 for the first) in a row."""
        return float(min(self.initial * 2 ** max(0, failures - 1), self.maximum))


@dataclass(frozen=True)
class ReplicaFailure:
    """A replica that is failing now, as a user should read it."""

    replica: int
    pod: str
    reason: str
    """What the pod status says about the last failure, when it says anything."""
    failures: int = 0
    """Failed pods in a row (0 for a container the kubelet restarts itself)."""
    delay: float = 0.0
    """Seconds the operator waits after the last failure before replacing the pod."""

    def describe(self) -> str:
        """One sentence for the Degraded condition (the same for every reconcile until the
        next failure, so the condition and its Event change only then)."""
        detail = f" ({self.reason})" if self.reason else ""
        if not self.failures:
            return (
                f"pod {self.pod} keeps exiting{detail}; the kubelet restarts it with a "
                "growing delay"
            )
        times = "once" if self.failures == 1 else f"{self.failures} times in a row"
        return (
            f"pod {self.pod} failed {times}{detail}; replica {self.replica} is replaced "
            f"{_seconds(self.delay)} after its last failure"
        )


@dataclass(frozen=True)
class ReplicaFailures:
    """What :meth:`FailureBackoff.observe` found for one ModelServer."""

    held: frozenset[int] = frozenset()
    """Replicas whose failed pod must stay for now."""
    failing: tuple[ReplicaFailure, ...] = ()
    """Replicas failing now, by replica index."""
    wake_in: float | None = None
    """Seconds until the first held replica may be replaced (``None``: nothing held)."""


@dataclass
class _Record:
    """One replica's run of failures."""

    failures: int
    template_hash: str
    failed_uid: str
    """The pod whose failure was counted last (each failed pod counts once)."""
    failed_at: float
    pod: str
    reason: str
    ready_since: float | None = None
    """When a pod of the replica was first seen ready since the last failure."""


class FailureBackoff:
    """Consecutive failures of each replica of each ModelServer (see the module)."""

    def __init__(
        self, policy: BackoffPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy or BackoffPolicy()
        self._clock = clock
        self._records: dict[tuple[ModelServerKey, int], _Record] = {}

    def observe(
        self, key: ModelServerKey, pods: Iterable[PodView], template_hash: str, replicas: int
    ) -> ReplicaFailures:
        """Count new failures among ModelServer ``key``'s ``pods`` and say what is held.

        ``template_hash`` is the current spec's and ``replicas`` its replica count.
        """
        now = self._clock()
        latest: dict[int, PodView] = {}
        for candidate in sorted(pods, key=lambda p: p.terminating):
            if candidate.replica < replicas:
                latest.setdefault(candidate.replica, candidate)
        for owner, replica in list(self._records):
            if owner == key and replica >= replicas:
                del self._records[(owner, replica)]

        held: set[int] = set()
        failing: list[ReplicaFailure] = []
        wake_at: float | None = None
        for replica in sorted({*latest, *(r for o, r in self._records if o == key)}):
            pod = latest.get(replica)
            record = self._records.get((key, replica))
            if pod is not None and pod.finished and not pod.terminating:
                record = self._count(key, pod, record, now)
                retry_at = record.failed_at + self.policy.delay(record.failures)
                if pod.template_hash == template_hash and now < retry_at:
                    held.add(replica)
                    wake_at = retry_at if wake_at is None else min(wake_at, retry_at)
            elif pod is not None and pod.ready:
                if record is not None:
                    if record.ready_since is None:
                        record.ready_since = now
                    if self._recovered(record, now):
                        del self._records[(key, replica)]
                continue
            elif pod is not None and pod.crash_looping:
                failing.append(ReplicaFailure(replica, pod.name, pod.crash_looping))
                continue
            if record is not None:
                failing.append(
                    ReplicaFailure(
                        replica,
                        record.pod,
                        record.reason,
                        record.failures,
                        self.policy.delay(record.failures),
                    )
                )
        return ReplicaFailures(
            held=frozenset(held),
            failing=tuple(failing),
            wake_in=None if wake_at is None else max(0.0, wake_at - now),
        )

    def _count(
        self, key: ModelServerKey, pod: PodView, record: _Record | None, now: float
    ) -> _Record:
        """The record of ``pod``'s replica with ``pod``'s failure counted (once)."""
        if record is not None and record.failed_uid == pod.uid:
            return record
        if (
            record is None
            or record.template_hash != pod.template_hash
            or self._recovered(record, now)
        ):
            failures = 1
        else:
            failures = record.failures + 1
        counted = _Record(failures, pod.template_hash, pod.uid, now, pod.name, pod.failure)
        self._records[(key, pod.replica)] = counted
        return counted

    def _recovered(self, record: _Record, now: float) -> bool:
        """Whether the replica has been ready long enough to forget its failures."""
        return (
            record.ready_since is not None and now - record.ready_since >= self.policy.reset_after
        )

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` was deleted."""
        for owner, replica in list(self._records):
            if owner == key:
                del self._records[(owner, replica)]


def _seconds(seconds: float) -> str:
    """``10s``, ``5m``, ``2m30s``."""
    minutes, rest = divmod(round(seconds), 60)
    if not minutes:
        return f"{rest}s"
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"
