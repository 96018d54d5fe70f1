"""The per-worker elastic KV pool: block ids for the engine, physical pages that follow use.

A :class:`KVPool` reserves virtual memory for the largest KV cache the engine could hold
and maps physical pages only where blocks are in use. The engine sees block ids
(``alloc``/``free``) and tensors over the reserved range (``tensor``).

Invariants
----------
- Block 0 is the null block: reserved at start, never handed out, never freed.
- A block id is either free in exactly one mapped page's free list, or allocated.
- Every logical page is in exactly one state: unmapped, busy (a page operation in
  flight), or mapped. A mapped page is *ready* (empty, kept ahead of demand), *partial*
  (some blocks free) or *full*.
- The pool never grows while it holds its lease: ``held <= limit`` after any growth, where
  ``held = mapped + busy`` pages. A lowered lease is honoured lazily: the pool stops
  growing, gives back ready pages, asks the engine to evict cached blocks, and unmaps
  pages as they empty; it never touches blocks in use.
- While over its lease, the pool *keeps* at most ``limit`` pages that hold blocks and
  *retires* the others: the emptiest ones (most free blocks, so they empty soonest),
  never page 0 (the null block never leaves it). New requests' blocks go only into kept
  pages; a retired page takes none, and once its last block is freed it is unmapped.
  So a backlog that refills every freed block cannot keep the pool over its lease: the
  retired pages empty as the requests on them finish, while allocation fails with
  :class:`Exhausted` once the kept pages are full (the engine queues or preempts). When
  the lease rises again, or a kept page empties, retired pages go back into service,
  fullest first.
- While over its lease, blocks that grow a request the engine already runs
  (``alloc(n, running=True)``) may also come from the free blocks of retired pages and
  from empty pages the pool still holds; maintenance keeps enough of those empty pages
  for one new block per request the engine runs (:meth:`KVPool.set_running_requests`; a
  decoding request takes at most one block a step). Otherwise a running request refused
  its next block is preempted and recomputed, and with one block per page there are no
  partial pages to serve it. New requests wait, so the pool still reaches its lease as
  requests finish.

- A page emptied while the engine still had steps in flight is unmapped only after
  them: pages picked for unmapping are stamped with the engine's steps scheduled so far
  (:attr:`KVPool.steps`) and wait, held and off every free list, until those steps are
  done; the backend's device fence covers the work already launched
  (:mod:`kvshare.runtime.fence`). Neither costs ``alloc`` or ``free`` anything.

Allocation is best fit: a request is served from the partial page with the fewest free
blocks that still fits it (pages with the fewest free blocks are filled first otherwise),
then from ready pages; so pages fill up densely and empty pages appear where they can be
unmapped. Partial pages sit in buckets by free count, indexed by a bit mask, so the
choice costs a few integer operations; block ids live in per-page free lists (no
per-block objects).

Threads and locks
-----------------
- ``_lock`` guards every piece of block and page bookkeeping. It is held only while
  bookkeeping, never across a backend call, a peer message, a lease call or an evictor
  call, so ``alloc``/``free`` never wait on the device, the network or the engine while
  holding it. ``_settled`` (a condition on ``_lock``) is notified when pages in flight
  settle: ``alloc``'s slow path waits on it when the only room left is pages another
  thread (the reserve thread, say) is creating or unmapping, as it would wait for
  creating them itself, rather than answer "no space" for memory a moment away.
- ``_limit_lock`` guards the lease limit against :meth:`KVPool.steady_lease` scopes: a
  lowered lease that arrives inside one waits in ``_deferred_limit`` until the last
  scope ends. Held only for a few assignments, never while taking another lock.
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
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvshare.runtime.errors import (
    InvalidBlockError,
    MapCountExceededError,
    OutOfDeviceMemoryError,
    PeerError,
    PoolClosedError,
    PoolError,
)
from kvshare.runtime.fence import StepFence
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseSource, PoolUsage
from kvshare.runtime.ownership import LocalOwnership, Ownership
from kvshare.runtime.pages import PageMapper

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.backends.base import Backend

__all__ = ["NULL_BLOCK", "Evictor", "Exhausted", "KVPool", "PoolSnapshot"]

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""The block id the pool reserves at start and never hands out (vLLM's null block, SGLang's
padding slot)."""

_UNMAPPED, _MAPPED, _BUSY = 0, 1, 2  # page states
_FREE, _ALLOCATED, _NEVER = 0, 1, 2  # block states (_NEVER: null block or straddling id)

DEFAULT_RESERVE_PAGES = 4
_ALLOC_ROUNDS = 4  # of the slow path, when other threads take the pages it waited for
_IN_FLIGHT_WAIT_S = 1.0  # longest wait for pages in flight before trying again
DEFAULT_LEASE_CHUNK_BYTES = 256 * 2**20
#: How often an unmet ask is said again: well within the broker's ``fresh_s`` (1 s), so a
#: pool still short never lapses, and short enough that an ask the pool no longer needs
#: stops holding memory within about a second.
_WANT_RETRY_S = 0.5
_SHRINK_POLL_S = 0.5


@dataclass(frozen=True)
class Exhausted:
    """What :meth:`KVPool.alloc` returns when it cannot serve a request. Falsy.

    Nothing was allocated. The engine preempts or queues and tries again later.
    """

    reason: str
    """Why: the lease is reached, the pool is shrinking, the virtual capacity is full, the
    device is out of memory, or the kernel's mapping limit is reached (with what to do)."""
    requested: int
    """Blocks asked for."""
    available: int
    """Blocks :meth:`KVPool.alloc` could have handed out at that moment."""

    def __bool__(self) -> bool:
        return False


class Evictor(Protocol):
    """The engine's prefix cache, as the pool sees it when it must give memory back."""

    def cached_blocks(self) -> int:
        """Blocks allocated from the pool that the engine keeps only as prefix cache."""

    def evict(self, n: int) -> int:
        """Drop up to ``n`` cached blocks, freeing them through :meth:`KVPool.free`; returns
        how many were freed.

        Called from the pool's background thread while no pool lock is held: the engine
        synchronises with its own scheduler (or records the request, returns 0, and frees
        on its next step).
        """


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
        )


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
        reserve_pages: int = DEFAULT_RESERVE_PAGES,
        background: bool = True,
        lease_chunk_bytes: int = DEFAULT_LEASE_CHUNK_BYTES,
        report_interval_s: float = 5.0,
        lease_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reserve_pages < 0:
            raise PoolError(f"reserve_pages must be >= 0, not {reserve_pages}")
        self.geometry = geometry
        self.backend = backend
        self.lease = lease
        self.ownership = ownership or LocalOwnership()
        self._reserve_pages = reserve_pages
        self._report_interval_s = report_interval_s
        # Times the pool's rate limits (asking again, reporting) are kept on; a simulation
        # without a background thread passes its own.
        self._clock = clock
        page_bytes = geometry.page_bytes
        self._page_bytes = page_bytes
        self._block_bytes = geometry.block_bytes
        self._page_size = geometry.page_size

        # Static layout: usable block ids of every page.
        num_pages = geometry.num_pages
        self._cap = [len(geometry.blocks_of(p)) for p in range(num_pages)]
        self._usable_pages = sum(1 for c in self._cap if c)
        self._max_cap = max(self._cap)
        # Fewest blocks a page other than page 0 brings: what available() counts per page.
        self._min_cap = min((c for c in self._cap[1:] if c), default=0)
        self._chunk_pages = max(1, reserve_pages, -(-lease_chunk_bytes // page_bytes))
        self._warn_about_waste()

        self._thread: threading.Thread | None = None
        self._init_state()
        self.steps = StepFence()
        """The engine's steps: its scheduler's hooks count them (see :class:`StepFence`)."""
        self.steps.watch(self._step_finished)

        self._mapper: PageMapper = self.ownership.open_mapper(geometry, backend, self._fail)
        try:
            lease.attach(self)
            self._set_limit(lease.limit())
            self._reserve_null_block(lease_timeout_s)
        except BaseException:
            self._mapper.close()
            raise
        if background:
            thread = threading.Thread(target=self._run, name="kvshare-pool-reserve", daemon=True)
            self._thread = thread
            thread.start()
            self._wake.set()
        log.info(
            "KV pool ready: %d blocks of %d bytes x %d buffers (%s), %d pages of %d bytes, "
            "lease %d bytes, %r",
            geometry.num_blocks,
            geometry.block_bytes,
            geometry.num_buffers,
            geometry.layout,
            self._usable_pages,
            page_bytes,
            self._limit_bytes,
            self.ownership,
        )

    # --- set-up ------------------------------------------------------------------------

    def _init_state(self) -> None:
        """Bookkeeping (guarded by ``_lock``), lease state and thread control."""
        self._lock = threading.Lock()
        # Notified (with _lock held) when pages in flight (being created, or unmapped and
        # released) settle: published, given up, or back among the unmapped ones.
        self._settled = threading.Condition(self._lock)
        self._maintain_lock = threading.Lock()
        self._bstate = bytearray(self.geometry.num_blocks)
        self._mark_straddling_blocks()
        self._pstate = bytearray(self.geometry.num_pages)
        self._fl: list[list[int]] = [[] for _ in range(self.geometry.num_pages)]
        self._buckets: list[dict[int, None]] = [{} for _ in range(self._max_cap + 1)]
        self._mask = 0  # bit k set <=> _buckets[k] is not empty
        self._ready: dict[int, None] = {}
        # Mapped pages given up while over the lease: no new blocks, unmapped once empty.
        self._retiring: dict[int, None] = {}
        self._planned_for = -1  # the limit (pages) the retiring set was chosen for
        self._unmapped = [p for p in range(self.geometry.num_pages) if self._cap[p]]
        heapq.heapify(self._unmapped)
        self._free_partial = 0  # free blocks in partial pages
        self._ready_blocks = 0  # free blocks in ready pages
        self._retired_free = 0  # free blocks in retired pages (for running requests only)
        self._mapped_pages = 0
        self._growing = 0  # busy pages being created and mapped
        self._dropping = 0  # busy pages being unmapped and released
        # Busy pages picked for unmapping that wait for the engine's steps in flight when
        # they were picked: (stamp, pages), oldest first. Held, off every free list.
        self._fenced: list[tuple[int, list[int]]] = []
        self._fenced_pages = 0
        self._held_pages = 0  # mapped + growing + dropping
        self._used_blocks = 0
        # Requests the engine runs into its next step (set_running_requests).
        self._running_requests = 0
        self._allocs = 0
        self._waits = 0
        self._error: PoolError | None = None
        self._closed = False
        self._evictor: Evictor | None = None

        # Lease state: written under _limit_lock (any thread), read without a lock.
        self._limit_lock = threading.Lock()
        self._limit_bytes = 0
        self._limit_pages = 0
        self._steady_scopes = 0
        self._deferred_limit: int | None = None
        self._lease_event = threading.Event()
        self._wanted = 0
        self._wanted_at = 0.0
        self._last_report: PoolUsage | None = None
        self._last_report_at = 0.0
        # A lowered lease is acknowledged by the next report, even when nothing changed.
        self._report_due = False
        self._map_limit_logged = False

        self._wake = threading.Event()
        self._stop = threading.Event()

    def _warn_about_waste(self) -> None:
        g = self.geometry
        if g.page_size % g.block_bytes:
            lost = g.page_size - (g.page_size // g.block_bytes) * g.block_bytes
            log.warning(
                "page size %d is not a multiple of the block size %d: about %d bytes of "
                "every page stay unused; a page size of %d would waste nothing",
                g.page_size,
                g.block_bytes,
                lost,
                math.lcm(g.page_size, g.block_bytes),
            )

    def _mark_straddling_blocks(self) -> None:
        if self._page_size % self._block_bytes == 0:
            return  # every block id below num_blocks lies inside one page
        usable = bytearray(len(self._bstate))
        for page in range(self.geometry.num_pages):
            blocks = self.geometry.blocks_of(page)
            usable[blocks.start : blocks.stop] = b"\x01" * len(blocks)
        for block, ok in enumerate(usable):
            if not ok:
                self._bstate[block] = _NEVER

    def _reserve_null_block(self, timeout_s: float) -> None:
        if self._limit_pages < 1:
            self._want(1)
            deadline = time.monotonic() + timeout_s
            while self._limit_pages < 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(
                        f"the lease ({self._limit_bytes} bytes) does not cover one page of "
                        f"{self._page_bytes} bytes, which the null block needs, and no larger "
                        f"lease came within {timeout_s:g} s; grant the pool at least one page "
                        "(KVSHARE_KV_LIMIT or kvCache.min)"
                    )
                # Said again every retry, as every other unmet ask is: the broker lets an
                # ask it has not heard for a while lapse.
                self._lease_event.wait(min(left, _WANT_RETRY_S))
                self._lease_event.clear()
                self._want(1)
        with self._lock:
            heapq.heappop(self._unmapped)  # page 0: the lowest usable page holds block 0
            self._pstate[0] = _BUSY
            self._growing += 1
            self._held_pages += 1
        self._grow([0])  # raises on failure: a pool without a null block cannot start

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
                return self._take(n, running)
        return self._alloc_growing(n, running)

    def _mapped_free(self, running: bool) -> int:
        """Free blocks an allocation may take without mapping a page: those of partial
        pages; of ready pages unless the pool is over its lease and the blocks are not for
        running requests; and for running requests those of retired pages. The retired
        pages are first brought up to date with the lease, so that what is counted here is
        what :meth:`_take` hands out (an engine that counts free blocks and then takes them
        cannot fail in between). ``_lock`` held."""
        if self._planned_for != self._limit_pages:
            self._plan_retiring()
        if running:
            return self._free_partial + self._retired_free + self._ready_blocks
        if self._held_pages <= self._limit_pages:
            return self._free_partial + self._ready_blocks
        return self._free_partial

    def _take(self, n: int, running: bool) -> list[int]:
        """Hand out ``n`` blocks from mapped pages, best fit (for ``running`` requests,
        retired pages before ready ones). ``_lock`` held; the caller checked that enough
        are free."""
        out: list[int] = []
        buckets = self._buckets
        fls = self._fl
        remaining = n
        while remaining:
            mask = self._mask
            fits = mask >> remaining
            if fits:  # the partial page with the fewest free blocks that still fits
                k = remaining + ((fits & -fits).bit_length() - 1)
            elif mask:  # no partial page fits: fill the fullest one completely
                k = (mask & -mask).bit_length() - 1
            elif running and self._retired_free:
                remaining -= self._take_retired(remaining, out)
                continue
            else:
                remaining -= self._take_ready(remaining, out)
                continue
            bucket = buckets[k]
            page = next(iter(bucket))
            del bucket[page]
            if not bucket:
                mask &= ~(1 << k)
            take = remaining if remaining < k else k
            fl = fls[page]
            out += fl[-1 : -take - 1 : -1]  # from the end of the list: lowest ids first
            del fl[-take:]
            left = k - take
            if left:
                buckets[left][page] = None
                mask |= 1 << left
            self._mask = mask
            self._free_partial -= take
            remaining -= take
        state = self._bstate
        for block in out:
            state[block] = _ALLOCATED
        self._used_blocks += n
        return out

    def _take_retired(self, wanted: int, out: list[int]) -> int:
        """Take blocks from the retired page with the fewest free ones (the one least
        likely to empty soon); returns how many. ``_lock`` held."""
        fls = self._fl
        page = min((p for p in self._retiring if fls[p]), key=lambda p: len(fls[p]))
        fl = fls[page]
        take = min(wanted, len(fl))
        out += fl[-1 : -take - 1 : -1]
        del fl[-take:]
        self._retired_free -= take
        return take

    def _take_ready(self, wanted: int, out: list[int]) -> int:
        """Start using the lowest ready page; returns how many blocks were taken."""
        page = min(self._ready)
        del self._ready[page]
        if self._held_pages > self._limit_pages:
            self._planned_for = -1  # over the lease: the page joins those kept, re-plan
        fl = self._fl[page]
        self._ready_blocks -= len(fl)
        take = min(wanted, len(fl))
        out += fl[-1 : -take - 1 : -1]
        del fl[-take:]
        if fl:
            self._buckets[len(fl)][page] = None
            self._mask |= 1 << len(fl)
            self._free_partial += len(fl)
        if len(self._ready) < self._reserve_pages:
            self._wake.set()
        return take

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back. All or nothing: a block that is not allocated (a double free,
        the null block, an unknown id) raises :class:`InvalidBlockError` and frees nothing."""
        if not isinstance(ids, list | tuple):
            ids = list(ids)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the KV pool is closed")
            state = self._bstate
            done = 0
            try:
                for block in ids:
                    if block <= 0 or state[block] != _ALLOCATED:
                        break
                    state[block] = _FREE
                    done += 1
            except (IndexError, TypeError):
                pass
            if done != len(ids):
                for block in ids[:done]:
                    state[block] = _ALLOCATED
                raise InvalidBlockError(self._explain_bad_block(ids[done]))
            self._return_blocks(ids)

    def _return_blocks(self, ids: Sequence[int]) -> None:
        """Put freed blocks back into their pages' free lists. ``_lock`` held."""
        fls = self._fl
        block_bytes, page_size = self._block_bytes, self._page_size
        before: dict[int, int] = {}
        for block in ids:
            page = block * block_bytes // page_size
            fl = fls[page]
            if page not in before:
                before[page] = len(fl)
            fl.append(block)
        buckets = self._buckets
        cap = self._cap
        mask = self._mask
        wake = False
        retiring = self._retiring
        for page, old in before.items():
            if page in retiring:  # out of service: it only waits to empty
                self._retired_free += len(fls[page]) - old
                if len(fls[page]) == cap[page]:
                    self._retired_free -= cap[page]
                    del retiring[page]
                    self._ready[page] = None  # dropped by maintenance while over the lease
                    self._ready_blocks += cap[page]
                    wake = True
                continue
            if old:
                bucket = buckets[old]
                del bucket[page]
                if not bucket:
                    mask &= ~(1 << old)
            new = len(fls[page])
            if new == cap[page]:  # empty: a ready page now (page 0 never: it keeps block 0)
                self._ready[page] = None
                self._ready_blocks += new
                self._free_partial -= old
                wake = True
            else:
                buckets[new][page] = None
                mask |= 1 << new
                self._free_partial += new - old
        self._mask = mask
        self._used_blocks -= len(ids)
        if wake and (
            len(self._ready) > self._reserve_pages or self._held_pages > self._limit_pages
        ):
            self._wake.set()

    def _explain_bad_block(self, block: object) -> str:
        if not isinstance(block, int) or isinstance(block, bool):
            return f"block id {block!r} is not an integer; nothing was freed"
        if block == NULL_BLOCK:
            return "block 0 is the null block and is never freed; nothing was freed"
        if not 0 < block < self.geometry.num_blocks:
            return (
                f"block {block} is outside the pool's {self.geometry.num_blocks} blocks; "
                "nothing was freed"
            )
        return f"block {block} is not allocated (freed twice?); nothing was freed"

    def short_of(self, blocks: int) -> None:
        """The engine held work back for want of ``blocks`` more blocks without asking
        :meth:`alloc` (it compared them with :meth:`available` first): ask the lease source
        for room for them, as an allocation it could not serve would. Never blocks."""
        with self._lock:
            if self._closed or self._held_pages > self._limit_pages:
                return  # shrinking: the broker asked for memory back
            free = self._free_partial + self._ready_blocks
            if blocks <= free:
                return
            wanted = (
                self._held_pages
                + -(-(blocks - free) // max(1, self._min_cap))
                + self._reserve_pages
            )
        self._want(wanted)

    def available(self, *, running: bool = False) -> int:
        """Blocks :meth:`alloc` could hand out right now, growing within the lease
        (``running``: to requests the engine already runs)."""
        with self._lock:
            return self._available(running)

    def set_running_requests(self, count: int) -> None:
        """The engine runs ``count`` requests into its next step (its scheduler says so
        after each step). While over its lease the pool keeps empty pages for one new
        block each (a decoding request takes at most one a step), so that no running
        request is preempted for want of a block the pool holds empty; a pool no engine
        tells keeps none."""
        if count < 0:
            raise ValueError(f"running requests must be >= 0, got {count}")
        with self._lock:
            self._running_requests = count

    def _available(self, running: bool = False) -> int:
        free = self._mapped_free(running)
        if self._held_pages > self._limit_pages:
            return free
        room = min(self._limit_pages - self._held_pages, len(self._unmapped))
        return free + room * self._min_cap

    # --- growing ---------------------------------------------------------------------------

    def _alloc_growing(self, n: int, running: bool) -> list[int] | Exhausted:
        """The slow path: map new pages for this request (the reserve did not cover it)."""
        rounds = 0
        while rounds < _ALLOC_ROUNDS:  # others may take the new pages first: try again
            with self._lock:
                if self._error is not None:
                    raise self._error
                free = self._mapped_free(running)
                over = self._held_pages > self._limit_pages
                if n <= free:
                    return self._take(n, running)
                pages, refusal = self._pick_pages_for(n - free, over)
                if not pages and not over and (self._growing or self._dropping):
                    # Pages in flight within the lease (being created for the reserve or
                    # another allocation, or unmapped to trim the reserve, giving room
                    # back) are a moment away: wait for them rather than say no. However
                    # long that takes (a slow device, a peer rank busy with its step), it
                    # is no round: every flight ends, grown, dropped or failed, and the
                    # engine counted these blocks as free (``available``) before asking.
                    self._settled.wait(_IN_FLIGHT_WAIT_S)
                    continue
                if pages:
                    self._waits += 1
                    available = 0
                else:
                    available = self._available(running)
                    wanted = (
                        self._held_pages
                        + -(-(n - free) // max(1, self._min_cap))
                        + self._reserve_pages
                    )
            rounds += 1
            if not pages:
                if over:
                    return Exhausted(refusal, n, available)
                limit = self._limit_pages
                self._want(wanted)
                if self._limit_pages > limit:
                    continue  # the source granted at once
                return Exhausted(refusal, n, available)
            failure = self._grow_or_refuse(pages)
            if failure is not None:
                return Exhausted(failure, n, self.available())
        return Exhausted("contended: other threads took the new pages first", n, 0)

    def _pick_pages_for(self, blocks: int, over: bool) -> tuple[list[int], str]:
        """Mark the lowest unmapped pages holding ``blocks`` busy. ``_lock`` held."""
        if over:
            return [], "shrinking: the lease was lowered and the pool is giving memory back"
        pages: list[int] = []
        got = 0
        while got < blocks and self._unmapped:
            page = heapq.heappop(self._unmapped)
            pages.append(page)
            got += self._cap[page]
        room = self._limit_pages - self._held_pages
        if got < blocks or len(pages) > room:
            for page in pages:
                heapq.heappush(self._unmapped, page)
            if got < blocks and len(pages) <= room:
                return [], "capacity: every block of the pool's virtual range is in use"
            return [], (
                f"lease: {len(pages) * self._page_bytes} more bytes needed, the pool holds "
                f"{self._held_pages * self._page_bytes} of {self._limit_bytes} leased bytes"
            )
        for page in pages:
            self._pstate[page] = _BUSY
        self._growing += len(pages)
        self._held_pages += len(pages)
        return pages, ""

    def _grow_or_refuse(self, pages: list[int]) -> str | None:
        """Grow ``pages``; a reason string when the device or kernel refused."""
        try:
            self._grow(pages)
        except OutOfDeviceMemoryError as exc:
            return f"device memory: {exc}"
        except MapCountExceededError as exc:
            if not self._map_limit_logged:
                log.error("%s", exc)
                self._map_limit_logged = True
            return f"map limit: {exc}"
        return None

    def _grow(self, pages: list[int]) -> None:
        """Create and map busy ``pages``, then publish them as ready. On failure the pages
        go back to unmapped and the error is raised."""
        try:
            self._mapper.create(pages)
            try:
                self._mapper.map(pages)
            except BaseException:
                self._mapper.release(pages)
                raise
        except PeerError as exc:
            self._fail(exc)
            raise
        except BaseException:
            with self._lock:
                self._growing -= len(pages)
                self._return_unmapped(pages)
                self._settled.notify_all()
            raise
        with self._lock:
            self._growing -= len(pages)
            self._mapped_pages += len(pages)
            for page in pages:
                self._publish(page)
            self._settled.notify_all()

    def _publish(self, page: int) -> None:
        """A freshly mapped page joins the pool. ``_lock`` held."""
        self._pstate[page] = _MAPPED
        blocks = self.geometry.blocks_of(page)
        fl = list(range(blocks.stop - 1, blocks.start - 1, -1))  # lowest ids come out first
        if page == 0:
            fl.pop()  # block 0: the null block, allocated for good
            self._bstate[NULL_BLOCK] = _NEVER
        self._fl[page] = fl
        if len(fl) == self._cap[page]:
            self._ready[page] = None
            self._ready_blocks += len(fl)
        elif fl:
            self._buckets[len(fl)][page] = None
            self._mask |= 1 << len(fl)
            self._free_partial += len(fl)

    # --- shrinking ---------------------------------------------------------------------------

    def _drop(self, pages: list[int]) -> None:
        """Unmap and release busy ``pages`` (taken out of the ready set by the caller)."""
        try:
            self._mapper.unmap(pages)
            self._mapper.release(pages)
        except PoolError as exc:
            self._fail(exc)
            raise
        with self._lock:
            self._dropping -= len(pages)
            self._return_unmapped(pages)
            self._settled.notify_all()

    def _return_unmapped(self, pages: list[int]) -> None:
        """Busy ``pages`` hold no memory any more. ``_lock`` held."""
        for page in pages:
            self._pstate[page] = _UNMAPPED
            heapq.heappush(self._unmapped, page)
        self._held_pages -= len(pages)

    def _pick_ready_to_drop(self, count: int) -> list[int]:
        """Take the highest ``count`` ready pages out of the pool. ``_lock`` held."""
        if count <= 0:
            return []
        pages = sorted(self._ready, reverse=True)[:count]
        for page in pages:
            del self._ready[page]
            self._ready_blocks -= len(self._fl[page])
            self._fl[page] = []
            self._pstate[page] = _BUSY
        self._mapped_pages -= len(pages)
        self._dropping += len(pages)
        return pages

    def _fence(self, picked: list[int]) -> list[int]:
        """Of the pages picked for unmapping now and earlier, those whose engine steps are
        done (the rest wait, see the module docstring). ``_lock`` held."""
        if picked:
            self._dropping -= len(picked)
            self._fenced.append((self.steps.stamp(), picked))
            self._fenced_pages += len(picked)
        due: list[int] = []
        while self._fenced and self.steps.passed(self._fenced[0][0]):
            _, pages = self._fenced.pop(0)
            due += pages
        if due:
            self._fenced_pages -= len(due)
            self._dropping += len(due)
        return due

    def _step_finished(self) -> None:
        """An engine step is done (its scheduler's thread): fenced pages may be due."""
        if self._fenced_pages:
            self._wake.set()

    def _spare_pages(self) -> int:
        """Empty pages kept while over the lease for the running requests' next blocks:
        one block each. ``_lock`` held."""
        return -(-self._running_requests // max(1, self._min_cap))

    def _plan_retiring(self) -> None:
        """Retire or restore pages so that at most ``limit`` pages holding blocks stay in
        service (see the module docstring). ``_lock`` held."""
        limit = self._limit_pages
        self._planned_for = limit
        kept = self._mapped_pages - len(self._ready) - len(self._retiring)
        if kept > limit:
            self._retire(kept - limit)
        elif kept < limit and self._retiring:
            self._restore(limit - kept)

    def _retire(self, count: int) -> None:
        """Take the ``count`` emptiest pages in service (never page 0) out of it: partial
        pages with the most free blocks first, then full pages. ``_lock`` held."""
        buckets = self._buckets
        chosen: list[int] = []
        for free in range(self._max_cap, 0, -1):
            if len(chosen) == count:
                break
            bucket = buckets[free]
            for page in sorted(bucket, reverse=True):
                if len(chosen) == count:
                    break
                if page:
                    del bucket[page]
                    self._free_partial -= free
                    self._retired_free += free
                    chosen.append(page)
            if not bucket:
                self._mask &= ~(1 << free)
        retiring, ready, fls, state = self._retiring, self._ready, self._fl, self._pstate
        for page in range(len(state) - 1, 0, -1):  # full pages, highest first
            if len(chosen) == count:
                break
            full = state[page] == _MAPPED and not fls[page]
            if full and page not in ready and page not in retiring:
                chosen.append(page)
        retiring.update(dict.fromkeys(chosen))

    def _restore(self, count: int) -> None:
        """Put up to ``count`` retired pages back into service, fullest first. ``_lock``
        held."""
        fls = self._fl
        for page in sorted(self._retiring, key=lambda p: len(fls[p]))[:count]:
            del self._retiring[page]
            free = len(fls[page])
            if free:
                self._buckets[free][page] = None
                self._mask |= 1 << free
                self._free_partial += free
                self._retired_free -= free

    def _evict_for_lease(self) -> bool:
        """Ask the engine to evict cached blocks to get under the lease; whether any went."""
        evictor = self._evictor
        over = self._held_pages - self._fenced_pages - self._limit_pages
        if evictor is None or over <= 0:
            return False
        wanted = min(evictor.cached_blocks(), over * self._max_cap)
        if wanted <= 0:
            return False
        freed = evictor.evict(wanted)
        log.info(
            "lease lowered: asked the engine to evict %d cached blocks, %d freed", wanted, freed
        )
        return freed > 0

    # --- the lease ---------------------------------------------------------------------------

    def lease_changed(self, limit: int) -> None:
        """The lease source granted or reclaimed: the pool may hold ``limit`` bytes now.

        Cheap and lock-free for the caller; the background thread acts on it (call
        :meth:`maintain` to act at once in a pool without one).
        """
        self._lease_moved(lowered=self._apply_limit(limit))

    def _lease_moved(self, *, lowered: bool) -> None:
        if lowered:
            self._report_due = True  # the next report acknowledges it, even if unchanged
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
        with self._limit_lock:
            self._steady_scopes += 1
        try:
            yield
        finally:
            with self._limit_lock:
                self._steady_scopes -= 1
                deferred = self._deferred_limit if self._steady_scopes == 0 else None
                if deferred is not None:  # applied under the lock: a newer limit wins
                    self._deferred_limit = None
                    self._set_limit(deferred)
            if deferred is not None:
                self._lease_moved(lowered=True)

    def _apply_limit(self, limit: int) -> bool:
        """Take ``limit`` as the lease, or keep it for later while a :meth:`steady_lease`
        scope is open and it is lower. Whether the lease went down now."""
        with self._limit_lock:
            lower = limit < self._limit_bytes
            if lower and self._steady_scopes:
                self._deferred_limit = limit
                return False
            self._deferred_limit = None
            self._set_limit(limit)
            return lower

    def _set_limit(self, limit: int) -> None:
        self._limit_bytes = limit
        self._limit_pages = min(max(0, limit) // self._page_bytes, self._usable_pages)

    def _want(self, pages: int) -> None:
        """Ask the lease source for ``pages`` worth of lease, in chunks, at most once per
        amount (or again after a while). Never called with ``_lock`` held."""
        chunk = self._chunk_pages
        total = min(-(-pages // chunk) * chunk, self._usable_pages) * self._page_bytes
        if total <= self._limit_bytes:
            return
        now = self._clock()
        # A reclaim does not end the hold-off: a pool reclaimed below what it asked asks for
        # as much again only after the retry interval. The broker took that memory for a
        # pool short of it; asking again at once contends for it straight back. Measured in
        # simulated time (``python -m kvshare.demo.elastic_sim``, 30 traces; seeds 0-5 at
        # latencies of 0.9, 1 and 1.1 ms, seeds 6-11 at 1 ms), re-asking at once lost
        # 0.014-0.022 of the gain share in each run and left a tenant below 0.9 of its due
        # on twice as many traces (4 against 2; 2 against 1).
        if total > self._wanted or now - self._wanted_at > _WANT_RETRY_S:
            self._wanted, self._wanted_at = total, now
            self.lease.want(total)

    # --- maintenance -------------------------------------------------------------------------

    def maintain(self) -> None:
        """One maintenance pass, as the background thread runs it: honour a lowered lease,
        trim or refill the reserve of ready pages, ask for lease, report usage."""
        with self._maintain_lock:
            if self._closed:
                return
            self._apply_limit(self.lease.limit())
            changed = self._rebalance()
            # The engine evicts in its own (LRU) order, which need not empty whole pages:
            # keep asking while that makes progress and the pool is still over its lease.
            while self._evict_for_lease():
                changed = self._rebalance() or changed  # unmap what the eviction emptied
            cache_pages = self._cache_pages()
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
                spare = self._free_partial // max(1, self._min_cap)
                spare += max(0, cache_pages - self._reserve_pages)
                ahead = max(0, self._reserve_pages - spare)
                desired = self._mapped_pages - len(self._ready) + ahead
            if desired > self._limit_pages:
                self._want(desired)
            report_due, self._report_due = self._report_due, False
            self._report(force=changed or report_due)

    def maintenance_due(self) -> bool:
        """Whether something woke the pool's background thread since the last call (a
        lease change, a reserve running low, freed pages to unmap, a step whose fenced
        pages are due); clears it. For a caller that drives a pool without its thread
        (``background=False``) the way the thread would: a :meth:`maintain` pass when woken
        and on the report timer."""
        due = self._wake.is_set()
        self._wake.clear()
        return due

    def _cache_pages(self) -> int:
        """Pages' worth of blocks the engine keeps only as prefix cache (0 without an
        evictor). Never called with ``_lock`` held (the evictor takes the engine's lock)."""
        evictor = self._evictor
        if evictor is None:
            return 0
        return evictor.cached_blocks() // max(1, self._min_cap)

    def _rebalance(self) -> bool:
        """Drop ready pages beyond the lease or the reserve, or refill the reserve within the
        lease. Whether anything changed."""
        with self._lock:
            self._plan_retiring()
            over = self._held_pages - self._limit_pages - self._fenced_pages
            if over > 0:
                # Down to the lease, and the reserve trimmed as well in the same pass.
                excess = len(self._ready) - self._reserve_pages
                droppable = len(self._ready) - self._spare_pages()
                drop = self._pick_ready_to_drop(min(max(over, excess), droppable))
                grow: list[int] = []
            else:
                drop = self._pick_ready_to_drop(len(self._ready) - self._reserve_pages)
                grow = self._pick_reserve_pages()
            drop = self._fence(drop)
        if drop:
            self._drop(drop)
        if grow:
            self._grow_or_refuse(grow)
        return bool(drop or grow)

    def _pick_reserve_pages(self) -> list[int]:
        """Mark the unmapped pages that would refill the reserve busy. ``_lock`` held."""
        deficit = self._reserve_pages - len(self._ready) - self._growing
        count = min(deficit, self._limit_pages - self._held_pages, len(self._unmapped))
        if count <= 0:
            return []
        pages = [heapq.heappop(self._unmapped) for _ in range(count)]
        for page in pages:
            self._pstate[page] = _BUSY
        self._growing += count
        self._held_pages += count
        return pages

    def _report(self, force: bool) -> None:
        usage = self.snapshot().usage()
        now = self._clock()
        if (
            force
            or usage != self._last_report
            or now - self._last_report_at >= (self._report_interval_s)
        ):
            self._last_report, self._last_report_at = usage, now
            self.lease.report(usage)

    def _run(self) -> None:
        while not self._stop.is_set():
            shrinking = self._held_pages > self._limit_pages
            self._wake.wait(_SHRINK_POLL_S if shrinking else self._report_interval_s)
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
        return self._mapper.tensor(first_buffer, count)

    def block_address(self, buffer: int, block: int) -> int:
        """The virtual address of ``block`` in ``buffer``: for native code that takes KV
        memory by address (and the demo's checks), without a torch view. Touching it is
        valid only while the block is allocated."""
        return self._mapper.block_address(buffer, block)

    def set_evictor(self, evictor: Evictor) -> None:
        """Register the engine's prefix cache (see :class:`Evictor`)."""
        self._evictor = evictor

    def snapshot(self) -> PoolSnapshot:
        """Sizes and counters now."""
        evictor = self._evictor
        cached_blocks = evictor.cached_blocks() if evictor is not None else 0
        pb = self._page_bytes
        with self._lock:
            used_pages = self._mapped_pages - len(self._ready)
            return PoolSnapshot(
                virtual=self.geometry.virtual_bytes,
                mapped=(self._mapped_pages + self._dropping + self._fenced_pages) * pb,
                used=used_pages * pb,
                cached=min(cached_blocks * self.geometry.block_bytes_all_buffers, used_pages * pb),
                reserved=self._growing * pb,
                ready=len(self._ready) * pb,
                lease=self._limit_bytes,
                limit=self._limit_pages * pb,
                used_blocks=self._used_blocks,
                available_blocks=self._available(),
                allocations=self._allocs,
                waits=self._waits,
            )

    def mapped_pages(self) -> frozenset[int]:
        """Page ids mapped now (ready, partial and full pages)."""
        with self._lock:
            return frozenset(p for p, s in enumerate(self._pstate) if s == _MAPPED)

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
                self._mapper.close()
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
