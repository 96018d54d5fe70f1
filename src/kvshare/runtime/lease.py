"""Leases: how much physical memory a KV pool may hold, and who decides.

A pool never holds more physical KV memory (mapped pages plus pre-created reserve pages)
than its lease. The lease comes from a :class:`LeaseSource`:

- :class:`StaticLease` — a fixed limit (``KVSHARE_KV_LIMIT``), for standalone use
  without a node agent;
- the broker client (:mod:`kvshare.runtime.broker_client`) — leases brokered by the node
  agent, grown in chunks from a background thread and lowered on reclaim.

Protocol between a pool and its source
--------------------------------------
1. The pool calls :meth:`LeaseSource.attach` once with itself as the
   :class:`LeaseHolder`.
2. :meth:`LeaseSource.limit` is the current lease in bytes. It is cheap (no I/O) and
   may be called on the allocation hot path.
3. When the pool would like more, it calls :meth:`LeaseSource.want` with the total it
   would like to hold. The call never blocks on I/O; a grant arrives later through
   :meth:`LeaseHolder.lease_changed`.
4. When the source lowers the limit (a reclaim), it calls
   :meth:`LeaseHolder.lease_changed` with the new, lower limit. The pool then shrinks
   lazily: it stops growing, evicts cached blocks, unmaps pages as they empty, and never
   touches blocks in use. It reports progress through :meth:`LeaseSource.report`.
5. :meth:`LeaseSource.report` carries the pool's usage, so the source can tell the
   broker what the pool really holds (and when a reclaim has been honoured).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

__all__ = ["LeaseHolder", "LeaseSource", "PoolUsage", "StaticLease"]


@dataclass(frozen=True)
class PoolUsage:
    """What a pool holds right now, in bytes of physical memory."""

    mapped: int
    """Bytes of physical pages mapped into the pool's virtual range."""
    used: int
    """Bytes of mapped pages that hold at least one live (allocated, uncached) block."""
    cached: int
    """Bytes of blocks the engine keeps only as prefix cache (evictable on reclaim)."""
    reserved: int
    """Bytes of physical pages created ahead of demand but not mapped."""
    limit: int | None = None
    """The lease the pool honoured when it took these numbers (``None``: not known). A
    source learns from it that a lowered lease was in force, so the pool held no more
    than it reports from then on."""
    page_bytes: int = 0
    """Physical bytes the pool maps and unmaps at a time (one logical page; 0: unknown)."""
    layout: str = ""
    """What one page holds (:class:`kvshare.runtime.paging.Paging`): ``block-outer`` or
    ``per-layer`` (``""``: not stated)."""
    layout_reason: str = ""
    """Why the pool keeps per-layer pages (:data:`kvshare.runtime.paging.LAYOUT_REASONS`)."""

    @property
    def held(self) -> int:
        """Physical bytes the pool holds: what its lease must cover."""
        return self.mapped + self.reserved


class LeaseHolder(Protocol):
    """The side of a pool that a lease source talks to."""

    def lease_changed(self, limit: int) -> None:
        """The lease is now ``limit`` bytes. Lower than what the pool holds = shrink.

        Called from the source's thread; must not block on the pool's allocation lock
        for long (implementations record the limit and act on their own thread).
        """


class LeaseSource(ABC):
    """Where a pool's permission to hold physical memory comes from."""

    @abstractmethod
    def attach(self, holder: LeaseHolder) -> None:
        """Register the pool whose lease this is (once, before any other call)."""

    @abstractmethod
    def limit(self) -> int:
        """The current lease in bytes. No I/O: safe on the allocation hot path."""

    @abstractmethod
    def want(self, total_bytes: int) -> None:
        """Ask for the lease to reach ``total_bytes``. Never blocks on I/O."""

    @abstractmethod
    def report(self, usage: PoolUsage) -> None:
        """Tell the source what the pool holds now (after growth, shrink, or on a timer)."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Give the lease back and release the source's resources."""


class StaticLease(LeaseSource):
    """A fixed lease, for a pool that runs without a node agent."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"a lease must be >= 0 bytes, not {limit_bytes}")
        self._limit = limit_bytes
        self._lock = threading.Lock()  # guards _last_usage
        self._last_usage: PoolUsage | None = None

    def attach(self, holder: LeaseHolder) -> None:
        """A static lease never changes, so it never calls the holder back."""
        del holder

    def limit(self) -> int:
        """The fixed limit."""
        return self._limit

    def want(self, total_bytes: int) -> None:
        """A static lease cannot grow; the pool sees the same limit."""
        del total_bytes

    def report(self, usage: PoolUsage) -> None:
        """Kept for :meth:`last_usage`."""
        with self._lock:
            self._last_usage = usage

    def last_usage(self) -> PoolUsage | None:
        """The last usage the pool reported, if any."""
        with self._lock:
            return self._last_usage
