"""A tensor-parallel rank's lease, held at what its group agrees on, step by step.

SGLang runs one scheduler per tensor-parallel rank, and the ranks must take the same
allocation decisions: a slot granted on one rank and refused on another puts their radix
trees and batches out of step. Each rank's pool has the lease of its own GPU, and those
leases differ and move independently. :class:`AgreedLease` holds a rank's pool at the
limit the whole group agreed on at the last scheduler step (the smallest rank lease),
which every rank applies at the same step; the rank's own lease is still what is asked
for, reported to, and taken back by its broker.
"""

from __future__ import annotations

import threading

from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage

__all__ = ["AgreedLease"]


class AgreedLease(LeaseSource):
    """Wraps a rank's own lease; :meth:`limit` is the group's agreed limit.

    Until the group first agrees (the scheduler's first iteration), the pool follows the
    rank's own lease: it needs page 0 for its null block before any scheduler runs.
    """

    def __init__(self, own: LeaseSource) -> None:
        self._own = own
        self._lock = threading.Lock()  # guards _agreed and _holder
        self._agreed: int | None = None
        self._holder: LeaseHolder | None = None

    def attach(self, holder: LeaseHolder) -> None:
        with self._lock:
            self._holder = holder
        self._own.attach(self)

    def lease_changed(self, limit: int) -> None:
        """The rank's own lease moved; once the group agrees, the pool follows the group."""
        with self._lock:
            holder = self._holder if self._agreed is None else None
        if holder is not None:
            holder.lease_changed(limit)

    def own_limit(self) -> int:
        """This rank's own lease, which the group takes into its next agreement."""
        return self._own.limit()

    def agree(self, limit: int) -> None:
        """The group agreed on ``limit`` (every rank calls this at the same step)."""
        with self._lock:
            changed = limit != self._agreed
            self._agreed = limit
            holder = self._holder
        if changed and holder is not None:
            holder.lease_changed(limit)

    def limit(self) -> int:
        with self._lock:
            agreed = self._agreed
        return self._own.limit() if agreed is None else agreed

    def want(self, total_bytes: int) -> None:
        self._own.want(total_bytes)

    def report(self, usage: PoolUsage) -> None:
        self._own.report(usage)

    def close(self) -> None:
        self._own.close()
