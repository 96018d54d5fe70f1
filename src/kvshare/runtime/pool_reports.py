"""What a pool says about itself: snapshots for the engine and tests, reports to its lease.

:class:`PoolSnapshot` is a read-only view of a pool; :class:`Reporter` tells the lease
source what the pool holds (:class:`~kvshare.runtime.lease.PoolUsage`) after changes, when
a lowered lease must be acknowledged, and on a timer. The reporter is driven by the pool's
maintenance only (under its ``_maintain_lock``), so it needs no lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvshare.runtime.lease import LeaseSource, PoolUsage
from kvshare.runtime.paging import Paging

__all__ = ["PoolSnapshot", "Reporter"]


@dataclass(frozen=True)
class PoolSnapshot:
    """A read-only view of a pool. Sizes in bytes of physical memory unless named blocks."""

    virtual: int
    """Size of the reserved virtual range."""
    mapped: int
    """Physical pages mapped into the range (ready pages included)."""
    used: int
    """Mapped pages holding at least one allocated block."""
    cached: int
    """Blocks the engine keeps only as prefix cache (reported by the evictor)."""
    reserved: int
    """Physical pages created but not (yet) mapped."""
    ready: int
    """Empty mapped pages kept ahead of demand (part of ``mapped``)."""
    lease: int
    """What the lease source grants."""
    limit: int
    """What the pool may hold now: the lease in whole pages, at most the virtual size."""
    used_blocks: int
    """Blocks allocated (the null block not counted)."""
    available_blocks: int
    """Blocks :meth:`KVPool.alloc` could hand out now."""
    allocations: int
    """``alloc`` calls that asked for at least one block."""
    waits: int
    """``alloc`` calls that had to create a page on the spot (the reserve was empty)."""
    page_bytes: int = 0
    """Physical memory one logical page maps: the pool's unit of growth and shrinking."""
    paging: Paging = field(default_factory=Paging)
    """What one page holds (block-outer or per-layer), and why."""

    @property
    def held(self) -> int:
        """Physical memory the pool holds: what its lease must cover."""
        return self.mapped + self.reserved

    def usage(self) -> PoolUsage:
        """The part of the snapshot a lease source is told about."""
        return PoolUsage(
            mapped=self.mapped,
            used=self.used,
            cached=self.cached,
            reserved=self.reserved,
            limit=self.limit,
            page_bytes=self.page_bytes,
            layout=self.paging.layout,
            layout_reason=self.paging.reason,
        )


class Reporter:
    """Reports a pool's usage to its lease source: when it changed, when ``due`` (a
    lowered lease is acknowledged by the next report, even if nothing changed), when
    forced, and at least every ``interval_s`` on ``clock``."""

    def __init__(self, lease: LeaseSource, interval_s: float, clock: Callable[[], float]) -> None:
        self._lease = lease
        self.interval_s = interval_s
        self._clock = clock
        self._last: PoolUsage | None = None
        self._last_at = 0.0
        self.due = False

    def report(self, usage: PoolUsage, *, force: bool) -> None:
        """Tell the lease source ``usage`` if it is time to."""
        force, self.due = force or self.due, False
        now = self._clock()
        if force or usage != self._last or now - self._last_at >= self.interval_s:
            self._last, self._last_at = usage, now
            self._lease.report(usage)
