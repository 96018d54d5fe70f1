"""The per-worker elastic KV pool: block ids for the engine, physical pages that follow use.

A :class:`KVPool` reserves virtual memory for the largest KV cache the engine could hold
and maps physical pages only where blocks are in use. The engine sees block ids
(``alloc``/``free``) and tensors over the reserved range (``tensor``).

The pool is composed of parts, each with one job and its own invariants:

- :class:`~kvshare.runtime.pool_blocks.PageBlocks` — which blocks of which mapped page
  are free; best-fit placement; ready, partial, full and retired pages;
- :class:`~kvshare.runtime.pool_pages.Pages` — page states, the page operations
  (create and map, unmap and release) and the step fence before an unmap;
- :class:`~kvshare.runtime.pool_lease.LeaseLimit` — the lease in whole pages, held
  steady while the engine counts and takes blocks;
- :class:`~kvshare.runtime.pool_reports.Reporter` — what the lease source is told.

This module decides when each happens: the allocation hot path, growth within the lease,
and maintenance (the reserve, shrinking, eviction, asking for lease, reports).

Invariants
----------
- Block 0 is the null block: reserved at start, never handed out, never freed.
- Every logical page is in exactly one state: unmapped, busy (a page operation in
  flight), or mapped.
- The pool never grows while it holds its lease: ``held <= limit`` after any growth, where
  ``held = mapped + busy`` pages. A lowered lease is honoured lazily: the pool stops
  growing, gives back ready pages, asks the engine to evict cached blocks, and unmaps
  pages as they empty; it never touches blocks in use.
- While over its lease, the pool keeps at most ``limit`` pages that hold blocks in
  service and *retires* the emptiest others (never page 0): they take no new request's
  blocks and are unmapped once empty, so a backlog that refills every freed block cannot
  keep the pool over its lease; running requests may still grow into them and into empty
  pages kept for them (:class:`~kvshare.runtime.pool_blocks.PageBlocks`,
  :meth:`KVPool.expect_blocks`).
- A page emptied while the engine still had steps in flight is unmapped only after
  them (:class:`~kvshare.runtime.pool_pages.Pages`, :attr:`KVPool.steps`). Neither costs
  ``alloc`` or ``free`` anything.

Threads and locks
-----------------
- ``_lock`` guards every piece of block and page bookkeeping. It is held only while
  bookkeeping, never across a backend call, a peer message, a lease call or an evictor
  call, so ``alloc``/``free`` never wait on the device, the network or the engine while
  holding it. ``_settled`` (a condition on ``_lock``) is notified when pages in flight
  settle: ``alloc``'s slow path waits on it when the only room left is pages another
  thread (the reserve thread, say) is creating or unmapping, as it would wait for
  creating them itself, rather than answer "no space" for memory a moment away.
- ``_maintain_lock`` serialises maintenance passes (the background thread and explicit
  :meth:`KVPool.maintain` calls). Order: ``_maintain_lock`` before ``_lock``.
- The background thread ("kvshare-pool-reserve") keeps ``reserve_pages`` ready pages
  created and mapped, trims ready pages beyond that, shrinks towards a lowered lease,
  asks the lease source for more in chunks, and reports usage after changes and on a
  timer. It calls :meth:`Evictor.evict` (see there).
- Page operations run outside ``_lock`` on pages marked busy, so no two operations ever
  touch one page at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from kvshare.runtime.errors import (
    MapCountExceededError,
    OutOfDeviceMemoryError,
    PoolClosedError,
    PoolError,
)
from kvshare.runtime.fence import StepFence
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseSource, PoolUsage
from kvshare.runtime.ownership import LocalOwnership, Ownership
from kvshare.runtime.paging import Paging
from kvshare.runtime.pool_blocks import NULL_BLOCK, Exhausted, PageBlocks, reserve_pages_for
from kvshare.runtime.pool_eviction import Eviction, Evictor
from kvshare.runtime.pool_lease import DEFAULT_LEASE_CHUNK_BYTES, WANT_RETRY_S, LeaseLimit
from kvshare.runtime.pool_pages import Pages
from kvshare.runtime.pool_reports import PoolSnapshot, Reporter

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.backends.base import Backend

__all__ = ["NULL_BLOCK", "Evictor", "Exhausted", "KVPool", "PoolSnapshot"]

log = logging.getLogger(__name__)

_ALLOC_ROUNDS = 4  # of the slow path, when other threads take the pages it waited for
_IN_FLIGHT_WAIT_S = 1.0  # longest wait for pages in flight before trying again
_WANT_RETRY_S = WANT_RETRY_S  # how often the first page's ask is said again
_SHRINK_POLL_S = 0.5


class KVPool:
    """The elastic KV pool of one worker. See the module docstring for the invariants.

    ``backend`` may be ``None`` only for the owner of a coordinated group that holds no KV
    memory itself. The pool takes ownership of ``lease`` and ``backend``: :meth:`close`
    closes them.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        backend: Backend | None,
        lease: LeaseSource,
        ownership: Ownership | None = None,
        *,
        reserve_pages: int | None = None,
        background: bool = True,
        lease_chunk_bytes: int = DEFAULT_LEASE_CHUNK_BYTES,
        report_interval_s: float = 5.0,
        lease_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        paging: Paging | None = None,
    ) -> None:
        if reserve_pages is None:  # the default: DEFAULT_RESERVE_BLOCKS blocks' worth
            reserve_pages = reserve_pages_for(geometry)
        if reserve_pages < 0:
            raise PoolError(f"reserve_pages must be >= 0, not {reserve_pages}")
        self.geometry = geometry
        self.backend = backend
        self.lease = lease
        self.ownership = ownership or LocalOwnership()
        self.paging = paging or Paging()
        """What one page holds (block-outer or per-layer), and why: told to the lease."""
        self._reserve_pages = reserve_pages
        self._page_bytes = page_bytes = geometry.page_bytes

        self._lock = threading.Lock()
        # Notified (with _lock held) when pages in flight (being created, or unmapped and
        # released) settle: published, given up, or back among the unmapped ones.
        self._settled = threading.Condition(self._lock)
        self._maintain_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: PoolError | None = None
        self._closed = False
        self._next_step_blocks = 0  # blocks the engine's running requests take next step
        self._allocs = 0
        self._waits = 0
        self._lease_event = threading.Event()
        self._map_limit_logged = False
        # ``clock`` times the pool's rate limits (asking again, reporting); a simulation
        # without a background thread passes its own.
        self._reporter = Reporter(lease, report_interval_s, clock)

        self.steps = StepFence()
        """The engine's steps: its scheduler's hooks count them (see :class:`StepFence`)."""
        self.steps.watch(self._step_finished)
        mapper = self.ownership.open_mapper(geometry, backend, self._fail)
        self._blocks = PageBlocks(geometry, reserve_pages, self._wake.set)
        self._pages = Pages(
            geometry,
            mapper,
            blocks=self._blocks,
            steps=self.steps,
            lock=self._lock,
            settled=self._settled,
            fail=self._fail,
        )
        self._eviction = Eviction(self._blocks.max_cap)
        usable_pages = sum(1 for c in self._blocks.cap if c)
        chunk_pages = max(1, reserve_pages, -(-lease_chunk_bytes // page_bytes))
        self._limit = LeaseLimit(lease, page_bytes, usable_pages, chunk_pages, clock)
        try:
            lease.attach(self)
            self._limit.apply(lease.limit())
            self._reserve_null_block(lease_timeout_s)
        except BaseException:
            mapper.close()
            raise
        if background:
            thread = threading.Thread(target=self._run, name="kvshare-pool-reserve", daemon=True)
            self._thread = thread
            thread.start()
            self._wake.set()
        log.info(
            "KV pool ready: %d blocks of %d bytes x %d buffers, %d pages of %d bytes (%s), "
            "lease %d bytes, %r",
            geometry.num_blocks,
            geometry.block_bytes,
            geometry.num_buffers,
            usable_pages,
            page_bytes,
            self.paging.layout,
            self._limit.bytes,
            self.ownership,
        )

    # --- set-up ------------------------------------------------------------------------

    def _reserve_null_block(self, timeout_s: float) -> None:
        if self._limit.pages < 1:
            self._limit.ask(1)
            deadline = time.monotonic() + timeout_s
            while self._limit.pages < 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(
                        f"the lease ({self._limit.bytes} bytes) does not cover one page of "
                        f"{self._page_bytes} bytes, which the null block needs, and no larger "
                        f"lease came within {timeout_s:g} s; grant the pool at least one page "
                        "(KVSHARE_KV_LIMIT or kvCache.min)"
                    )
                # Said again every retry, as every other unmet ask is: the broker lets an
                # ask it has not heard for a while lapse.
                self._lease_event.wait(min(left, _WANT_RETRY_S))
                self._lease_event.clear()
                self._limit.ask(1)
        with self._lock:
            pages = self._pages.pick_lowest(1)  # page 0: the lowest usable page holds block 0
        self._pages.grow(pages)  # raises on failure: a pool without a null block cannot start

    # --- the engine's hot path -----------------------------------------------------------

    def alloc(self, n: int, *, running: bool = False) -> list[int] | Exhausted:
        """``n`` distinct block ids, or a falsy :class:`Exhausted` (nothing allocated).

        ``running``: the blocks grow a request the engine already runs. While the pool is
        over its lease those may also come from its empty pages not yet given back, so a
        request that is finishing is not preempted for memory the pool still holds (see
        the module docstring); new requests wait.

        Never raises for lack of memory and never returns the null block. Raises
        :class:`~kvshare.runtime.errors.PeerError` when a tensor-parallel peer failed,
        :class:`~kvshare.runtime.errors.PoolClosedError` after :meth:`close`.
        """
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if self._error is not None:
                raise self._error
            self._allocs += 1
            if n <= self._mapped_free(running):
                return self._blocks.take(n, running, self._pages.held > self._limit.pages)
        return self._alloc_growing(n, running)

    def _mapped_free(self, running: bool) -> int:
        """Free blocks an allocation may take without mapping a page (see
        :meth:`PageBlocks.free_for`). The retired pages are first brought up to date with
        the lease, so that what is counted here is what ``take`` hands out (an engine that
        counts free blocks and then takes them cannot fail in between). ``_lock`` held."""
        limit = self._limit.pages
        blocks = self._blocks
        if blocks.planned_for != limit:
            blocks.plan(limit, self._pages.mapped)
        return blocks.free_for(running, self._pages.held > limit)

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back. All or nothing: a block that is not allocated (a double free,
        the null block, an unknown id) raises :class:`InvalidBlockError` and frees nothing."""
        if not isinstance(ids, list | tuple):
            ids = list(ids)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the KV pool is closed")
            self._blocks.free(ids, self._pages.held > self._limit.pages)

    def short_of(self, blocks: int) -> None:
        """The engine held work back for want of ``blocks`` more blocks without asking
        :meth:`alloc` (it compared them with :meth:`available` first): ask the lease source
        for room for them, as an allocation it could not serve would. Never blocks."""
        with self._lock:
            held = self._pages.held
            if self._closed or held > self._limit.pages:
                return  # shrinking: the broker asked for memory back
            free = self._blocks.free_partial + self._blocks.ready_blocks
            if blocks <= free:
                return
            wanted = held + self._pages_for(blocks - free) + self._reserve_pages
        self._limit.ask(wanted)

    def _pages_for(self, blocks: int) -> int:
        return -(-blocks // max(1, self._blocks.min_cap))

    def available(self, *, running: bool = False) -> int:
        """Blocks :meth:`alloc` could hand out right now, growing within the lease
        (``running``: to requests the engine already runs)."""
        with self._lock:
            return self._available(running)

    def expect_blocks(self, count: int) -> None:
        """The engine's running requests take at most ``count`` new blocks in its next
        step (said after each step: a decoding request takes one when its next token
        starts a block). While over its lease the pool keeps empty pages for them, so that
        no running request is preempted for want of a block the pool holds empty, and no
        more (they would hold back a reclaim); a pool no engine tells keeps none."""
        if count < 0:
            raise ValueError(f"expected blocks must be >= 0, got {count}")
        with self._lock:
            self._next_step_blocks = count

    def _available(self, running: bool = False) -> int:
        free = self._mapped_free(running)
        pages = self._pages
        if pages.held > self._limit.pages:
            return free
        # Pages on their way out serve now (fenced: rescued) or soon (unmapping: alloc waits).
        dropping = pages.dropping
        room = min(self._limit.pages - pages.held + dropping, len(pages.unmapped) + dropping)
        return free + pages.fenced_blocks + room * self._blocks.min_cap

    # --- growing ---------------------------------------------------------------------------

    def _alloc_growing(self, n: int, running: bool) -> list[int] | Exhausted:
        """The slow path: map new pages for this request (the reserve did not cover it)."""
        rounds = 0
        while rounds < _ALLOC_ROUNDS:  # others may take the new pages first: try again
            with self._lock:
                if self._error is not None:
                    raise self._error
                free = self._mapped_free(running)
                pages = self._pages
                over = pages.held > self._limit.pages
                if n > free and not over and pages.fenced:
                    pages.rescue(n - free)
                    free = self._mapped_free(running)
                if n <= free:
                    return self._blocks.take(n, running, over)
                picked, refusal = self._pick_pages_for(n - free, over)
                if not picked and not over and (pages.growing or pages.dropping):
                    # Pages in flight within the lease (being created for the reserve or
                    # another allocation, or unmapped to trim the reserve, giving room
                    # back) are a moment away: wait for them rather than say no. However
                    # long that takes (a slow device, a peer rank busy with its step), it
                    # is no round: every flight ends, grown, dropped or failed, and the
                    # engine counted these blocks as free (``available``) before asking.
                    self._settled.wait(_IN_FLIGHT_WAIT_S)
                    continue
                if picked:
                    self._waits += 1
                    available = 0
                else:
                    available = self._available(running)
                    wanted = pages.held + self._pages_for(n - free) + self._reserve_pages
            rounds += 1
            if not picked:
                if over:
                    return Exhausted(refusal, n, available)
                limit = self._limit.pages
                self._limit.ask(wanted)
                if self._limit.pages > limit:
                    continue  # the source granted at once
                return Exhausted(refusal, n, available)
            failure = self._grow_or_refuse(picked)
            if failure is not None:
                return Exhausted(failure, n, self.available())
        return Exhausted("contended: other threads took the new pages first", n, 0)

    def _pick_pages_for(self, blocks: int, over: bool) -> tuple[list[int], str]:
        """Mark the lowest unmapped pages holding ``blocks`` busy, or say why not.
        ``_lock`` held."""
        if over:
            return [], "shrinking: the lease was lowered and the pool is giving memory back"
        pages = self._pages
        picked, count, capacity = pages.pick_holding(blocks, self._limit.pages - pages.held)
        if picked:
            return picked, ""
        if capacity:
            return [], "capacity: every block of the pool's virtual range is in use"
        return [], (
            f"lease: {count * self._page_bytes} more bytes needed, the pool holds "
            f"{pages.held * self._page_bytes} of {self._limit.bytes} leased bytes"
        )

    def _grow_or_refuse(self, pages: list[int]) -> str | None:
        """Grow ``pages``; a reason string when the device or kernel refused."""
        try:
            self._pages.grow(pages)
        except OutOfDeviceMemoryError as exc:
            return f"device memory: {exc}"
        except MapCountExceededError as exc:
            if not self._map_limit_logged:
                log.error("%s", exc)
                self._map_limit_logged = True
            return f"map limit: {exc}"
        return None

    # --- shrinking ---------------------------------------------------------------------------

    def _step_finished(self) -> None:
        """An engine step is done (its scheduler's thread): fenced pages may be due."""
        if self._pages.fenced:
            self._wake.set()

    def _spare_pages(self) -> int:
        """Empty pages kept while over the lease for the running requests' next blocks
        (:meth:`expect_blocks`). ``_lock`` held."""
        return -(-self._next_step_blocks // max(1, self._blocks.min_cap))

    # --- the lease ---------------------------------------------------------------------------

    def lease_changed(self, limit: int) -> None:
        """The lease source granted or reclaimed: the pool may hold ``limit`` bytes now.

        Cheap and lock-free for the caller; the background thread acts on it (call
        :meth:`maintain` to act at once in a pool without one).
        """
        self._lease_moved(lowered=self._limit.apply(limit))

    def _lease_moved(self, *, lowered: bool) -> None:
        if lowered:
            self._reporter.due = True  # the next report acknowledges it, even if unchanged
        self._lease_event.set()
        self._wake.set()

    @contextlib.contextmanager
    def steady_lease(self) -> Iterator[None]:
        """A scope in which the lease does not drop: one engine decision that first asks
        how many blocks it could have (:meth:`available`) and then takes them.

        vLLM's scheduler checks the free block count and allocates later in the same
        step; a reclaim landing in between would make the allocation fail where vLLM has
        no way to fail. Inside the scope a lowered lease waits and takes effect (and is
        acknowledged to the lease source) when the last scope ends; a raised lease
        applies at once. The broker counts the old lease as taken until the pool
        acknowledges, so waiting never over-commits the GPU. Scopes may nest and overlap
        across threads; keep them short (a step, not a request).
        """
        with self._limit.steady(lambda: self._lease_moved(lowered=True)):
            yield

    # --- maintenance -------------------------------------------------------------------------

    def maintain(self) -> None:
        """One maintenance pass, as the background thread runs it: honour a lowered lease,
        trim or refill the reserve of ready pages, ask for lease, report usage."""
        with self._maintain_lock:
            if self._closed:
                return
            self._limit.apply(self.lease.limit())
            changed = self._rebalance()
            # The engine evicts in its own (LRU) order, which need not empty whole pages:
            # keep asking while that makes progress and the pool is still over its lease.
            while self._eviction.run(self._pages.held - self._pages.fenced - self._limit.pages):
                changed = self._rebalance() or changed  # unmap what the eviction emptied
            # Pages' worth of prefix cache; asked outside _lock (the evictor takes the engine's).
            cache_pages = self._eviction.cached_blocks() // max(1, self._blocks.min_cap)
            with self._lock:
                # Ready pages are kept so that new blocks need not wait for a page to be
                # mapped. Free blocks in pages already mapped serve as fast, and so does
                # the engine's own prefix cache beyond a reserve's worth of it (it reuses
                # cached blocks when the pool has no fresh ones; the first ones may be a
                # prefix its next requests hit): room the pool has is no reason to ask
                # the broker for more. A server whose lease is full of cache, or of pages
                # its finished requests left partly empty, would otherwise ask for ever,
                # keep what it holds from a pool that waits, and reclaims would trade one
                # server's cache for another's.
                spare = self._blocks.free_partial // max(1, self._blocks.min_cap)
                spare += max(0, cache_pages - self._reserve_pages)
                ahead = max(0, self._reserve_pages - spare)
                desired = self._pages.mapped - len(self._blocks.ready) + ahead
            if desired > self._limit.pages:
                self._limit.ask(desired)
            self._reporter.report(self.snapshot().usage(), force=changed)

    def maintenance_due(self) -> bool:
        """Whether something woke the pool's background thread since the last call (a
        lease change, a reserve running low, freed pages to unmap, a step whose fenced
        pages are due); clears it. For a caller that drives a pool without its thread
        (``background=False``) the way the thread would: a :meth:`maintain` pass when woken
        and on the report timer."""
        due = self._wake.is_set()
        self._wake.clear()
        return due

    def _rebalance(self) -> bool:
        """Drop ready pages beyond the lease or the reserve, or refill the reserve within the
        lease. Whether anything changed."""
        pages, blocks = self._pages, self._blocks
        with self._lock:
            limit = self._limit.pages
            blocks.plan(limit, pages.mapped)
            over = pages.held - limit - pages.fenced
            ready = len(blocks.ready)
            if over > 0:
                # Down to the lease and the reserve; spare pages are kept only while over.
                excess, droppable = ready - self._reserve_pages, ready - self._spare_pages()
                keep_spares = droppable < over
                drop = blocks.take_ready_pages(droppable if keep_spares else max(over, excess))
                grow: list[int] = []
            else:
                drop = blocks.take_ready_pages(ready - self._reserve_pages)
                deficit = self._reserve_pages - len(blocks.ready) - pages.growing
                grow = pages.pick_lowest(min(deficit, limit - pages.held))
            pages.start_dropping(drop)
            drop = pages.fence(drop)
        if drop:
            pages.drop(drop)
        if grow:
            self._grow_or_refuse(grow)
        return bool(drop or grow)

    def _run(self) -> None:
        while not self._stop.is_set():
            shrinking = self._pages.held > self._limit.pages
            self._wake.wait(_SHRINK_POLL_S if shrinking else self._reporter.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maintain()
            except PoolError:
                log.exception("KV pool maintenance failed")
            except Exception:
                log.exception("KV pool maintenance failed unexpectedly")

    def _fail(self, exc: PoolError) -> None:
        """A peer or the backend failed: every later ``alloc`` raises ``exc``."""
        if self._error is None:
            log.error("KV pool failed: %s", exc)
            self._error = exc
        self._wake.set()

    # --- views -------------------------------------------------------------------------------

    def tensor(self, first_buffer: int, count: int = 1) -> torch.Tensor:
        """A zero-copy uint8 tensor over buffers ``[first_buffer, first_buffer + count)``,
        shaped ``(count, num_blocks, block_bytes)``. Engines ``.view(dtype)`` it and reshape
        the last dimension, e.g. K and V of one layer as ``(2, num_blocks, ...)``."""
        return self._pages.mapper.tensor(first_buffer, count)

    def block_address(self, buffer: int, block: int) -> int:
        """The virtual address of ``block`` in ``buffer``: for native code that takes KV
        memory by address (and the demo's checks), without a torch view. Touching it is
        valid only while the block is allocated."""
        return self._pages.mapper.block_address(buffer, block)

    def set_evictor(self, evictor: Evictor) -> None:
        """Register the engine's prefix cache (see :class:`Evictor`)."""
        self._eviction.evictor = evictor

    def snapshot(self) -> PoolSnapshot:
        """Sizes and counters now."""
        cached_blocks = self._eviction.cached_blocks()
        pb = self._page_bytes
        pages, blocks = self._pages, self._blocks
        with self._lock:
            used_pages = pages.mapped - len(blocks.ready)
            return PoolSnapshot(
                virtual=self.geometry.virtual_bytes,
                mapped=(pages.mapped + pages.dropping + pages.fenced) * pb,
                used=used_pages * pb,
                cached=min(cached_blocks * self.geometry.block_bytes_all_buffers, used_pages * pb),
                reserved=pages.growing * pb,
                ready=len(blocks.ready) * pb,
                lease=self._limit.bytes,
                limit=self._limit.pages * pb,
                used_blocks=blocks.used_blocks,
                available_blocks=self._available(),
                allocations=self._allocs,
                waits=self._waits,
                page_bytes=pb,
                paging=self.paging,
            )

    def mapped_pages(self) -> frozenset[int]:
        """Page ids mapped now (ready, partial and full pages)."""
        with self._lock:
            return self._pages.mapped_pages()

    # --- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background thread, unmap and release every page, give the virtual range
        back, close the lease and the backend. Idempotent. Tensors from :meth:`tensor` must
        not be touched afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._error = PoolClosedError("the KV pool is closed")
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._maintain_lock:
            try:
                self._pages.mapper.close()
            except PoolError:
                log.exception("closing the KV pool's pages failed")
            self.lease.report(PoolUsage(mapped=0, used=0, cached=0, reserved=0))
            self.lease.close()
            if self.backend is not None:
                self.backend.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
