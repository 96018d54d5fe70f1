"""Helpers for the runtime tests: a lease whose limit a test moves, and an engine's cache.

:class:`MovableLease` stands in for the node agent's broker lease (a separate part, tested
there): it is a real :class:`LeaseSource` whose grants and reclaims the test decides.
"""

from __future__ import annotations

import functools
import threading

from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage
from kvshare.runtime.pool import KVPool
from tests import polling

MIB = 2**20


class MovableLease(LeaseSource):
    """A lease that grants ``want`` up to ``grant_up_to`` and is lowered by :meth:`set_limit`."""

    def __init__(self, limit: int, grant_up_to: int = 0) -> None:
        self._limit = limit
        self.grant_up_to = grant_up_to
        self.wants: list[int] = []
        self.reports: list[PoolUsage] = []
        self.closed = False
        self._holder: LeaseHolder | None = None
        self._lock = threading.Lock()

    def attach(self, holder: LeaseHolder) -> None:
        self._holder = holder

    def limit(self) -> int:
        return self._limit

    def want(self, total_bytes: int) -> None:
        with self._lock:
            self.wants.append(total_bytes)
        granted = min(total_bytes, self.grant_up_to)
        if granted > self._limit:
            self.set_limit(granted)

    def report(self, usage: PoolUsage) -> None:
        with self._lock:
            self.reports.append(usage)

    def set_limit(self, limit: int) -> None:
        self._limit = limit
        if self._holder is not None:
            self._holder.lease_changed(limit)

    def close(self) -> None:
        self.closed = True


class PrefixCache:
    """An engine's prefix cache: blocks it keeps allocated only as cache, evicted on demand."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.evict_calls: list[int] = []

    def cached_blocks(self) -> int:
        return len(self.blocks)

    def evict(self, n: int) -> int:
        self.evict_calls.append(n)
        victims, self.blocks = self.blocks[:n], self.blocks[n:]
        self.pool.free(victims)
        return len(victims)


#: The runtime's waits are short: a lease or a page moves within a few seconds.
wait_until = functools.partial(polling.wait_until, timeout=20.0)
