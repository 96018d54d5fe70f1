"""A pool's logical pages: their states, the memory operations on them, and the fence before unmap.

:class:`Pages` keeps, for one :class:`~kvshare.runtime.pool.KVPool`, which logical pages
are unmapped, busy (a page operation in flight) or mapped, counts what the pool holds, and
runs the page operations (create and map, unmap and release) through the pool's
:class:`~kvshare.runtime.pages.PageMapper`. Its bookkeeping methods run with the pool's
``_lock`` held; :meth:`Pages.grow` and :meth:`Pages.drop` take it themselves, only around
bookkeeping, never across a backend call (the pages they work on are busy, so no other
thread touches them meanwhile).

Fences: a page emptied while the engine still had steps in flight is unmapped only after
them. Pages picked for unmapping are stamped with the engine's steps scheduled so far and
wait, held and off every free list, until those steps are done (:meth:`Pages.fence`); the
backend's device fence covers the work already launched (:mod:`kvshare.runtime.fence`).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable

from kvshare.runtime.errors import PeerError, PoolError
from kvshare.runtime.fence import StepFence
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pages import PageMapper
from kvshare.runtime.pool_blocks import PageBlocks

__all__ = ["Pages"]

UNMAPPED, MAPPED, BUSY = 0, 1, 2  # page states


class Pages:
    """The logical pages of one pool. A freshly mapped page's blocks join ``blocks``;
    ``lock`` and ``settled`` are the pool's (``settled`` is notified when pages in flight
    settle); ``fail`` records a peer or backend failure."""

    def __init__(
        self,
        geometry: KVGeometry,
        mapper: PageMapper,
        *,
        blocks: PageBlocks,
        steps: StepFence,
        lock: threading.Lock,
        settled: threading.Condition,
        fail: Callable[[PoolError], None],
    ) -> None:
        self.geometry = geometry
        self.mapper = mapper
        self._blocks = blocks
        self._steps = steps
        self._lock = lock
        self._settled = settled
        self._fail = fail
        self.state = bytearray(geometry.num_pages)
        """Every page's state: unmapped, busy or mapped (published)."""
        self.unmapped = [p for p in range(geometry.num_pages) if blocks.cap[p]]
        heapq.heapify(self.unmapped)
        self.mapped = 0  # published pages
        self.growing = 0  # busy pages being created and mapped
        self.dropping = 0  # busy pages being unmapped and released
        self.held = 0  # mapped + growing + dropping
        # Busy pages picked for unmapping that wait for the engine's steps in flight when
        # they were picked: (stamp, pages), oldest first. Held, off every free list.
        self._fenced: list[tuple[int, list[int]]] = []
        self.fenced = 0

    # --- picking pages (lock held) -------------------------------------------------------

    def pick_lowest(self, count: int) -> list[int]:
        """Mark the ``count`` lowest unmapped pages busy, to be grown."""
        count = min(count, len(self.unmapped))
        if count <= 0:
            return []
        pages = [heapq.heappop(self.unmapped) for _ in range(count)]
        self._start_growing(pages)
        return pages

    def pick_holding(self, blocks: int, room: int) -> tuple[list[int], int, bool]:
        """Mark the lowest unmapped pages holding ``blocks`` blocks busy, if at most
        ``room`` pages do. Returns the pages (none when refused), how many pages it took
        or would have taken, and whether the refusal is for lack of virtual capacity
        rather than of lease."""
        pages: list[int] = []
        got = 0
        while got < blocks and self.unmapped:
            page = heapq.heappop(self.unmapped)
            pages.append(page)
            got += self._blocks.cap[page]
        if got < blocks or len(pages) > room:
            for page in pages:
                heapq.heappush(self.unmapped, page)
            return [], len(pages), got < blocks and len(pages) <= room
        self._start_growing(pages)
        return pages, len(pages), False

    def _start_growing(self, pages: list[int]) -> None:
        for page in pages:
            self.state[page] = BUSY
        self.growing += len(pages)
        self.held += len(pages)

    def start_dropping(self, pages: list[int]) -> None:
        """Published ``pages`` (taken out of the pool's free lists) are to be unmapped."""
        for page in pages:
            self.state[page] = BUSY
        self.mapped -= len(pages)
        self.dropping += len(pages)

    def fence(self, picked: list[int]) -> list[int]:
        """Of the pages picked for unmapping now and earlier, those whose engine steps are
        done (the rest wait, see the module docstring)."""
        if picked:
            self.dropping -= len(picked)
            self._fenced.append((self._steps.stamp(), picked))
            self.fenced += len(picked)
        due: list[int] = []
        while self._fenced and self._steps.passed(self._fenced[0][0]):
            _, pages = self._fenced.pop(0)
            due += pages
        if due:
            self.fenced -= len(due)
            self.dropping += len(due)
        return due

    def rescue(self, blocks: int) -> None:
        """Put fenced pages back in service, newest first, until they hold ``blocks``
        blocks or none is left. They are still mapped, and a block reused after the steps
        that read it is what the engine does with every freed block: only unmapping must
        wait for those steps, not reuse."""
        got = 0
        while got < blocks and self._fenced:
            pages = self._fenced[-1][1]
            page = pages.pop()
            if not pages:
                self._fenced.pop()
            self.fenced -= 1
            self.mapped += 1
            self.state[page] = MAPPED
            self._blocks.publish(page)
            got += self._blocks.cap[page]

    @property
    def fenced_blocks(self) -> int:
        """Blocks of the fenced pages (free, still mapped: :meth:`rescue` serves them)."""
        return sum(self._blocks.cap[page] for _, pages in self._fenced for page in pages)

    def _return_unmapped(self, pages: list[int]) -> None:
        """Busy ``pages`` hold no memory any more."""
        for page in pages:
            self.state[page] = UNMAPPED
            heapq.heappush(self.unmapped, page)
        self.held -= len(pages)

    def mapped_pages(self) -> frozenset[int]:
        """Page ids mapped now (ready, partial and full pages)."""
        return frozenset(p for p, s in enumerate(self.state) if s == MAPPED)

    # --- page operations (lock not held) -------------------------------------------------

    def grow(self, pages: list[int]) -> None:
        """Create and map busy ``pages``, then publish them. On failure the pages go back
        to unmapped and the error is raised."""
        mapper = self.mapper
        try:
            mapper.create(pages)
            try:
                mapper.map(pages)
            except BaseException:
                mapper.release(pages)
                raise
        except PeerError as exc:
            self._fail(exc)
            raise
        except BaseException:
            with self._lock:
                self.growing -= len(pages)
                self._return_unmapped(pages)
                self._settled.notify_all()
            raise
        with self._lock:
            self.growing -= len(pages)
            self.mapped += len(pages)
            for page in pages:
                self.state[page] = MAPPED
                self._blocks.publish(page)
            self._settled.notify_all()

    def drop(self, pages: list[int]) -> None:
        """Unmap and release busy ``pages`` (taken out of the pool by the caller)."""
        try:
            self.mapper.unmap(pages)
            self.mapper.release(pages)
        except PoolError as exc:
            self._fail(exc)
            raise
        with self._lock:
            self.dropping -= len(pages)
            self._return_unmapped(pages)
            self._settled.notify_all()
