"""Where a pool's free blocks are: per-page free lists, best-fit buckets, ready and retired pages.

:class:`PageBlocks` is the block-level bookkeeping of one :class:`~kvshare.runtime.pool.KVPool`.
It never calls a backend and takes no lock: every method runs with the pool's ``_lock``
held.

Invariants
----------
- Block 0 is the null block: allocated for good once page 0 is published.
- A block id is either free in exactly one published page's free list, or allocated, or
  never handed out (the null block and ids that would straddle two pages).
- A published page is *ready* (every block free, kept ahead of demand), *partial* (some
  blocks free, indexed in ``buckets`` by free count), *full*, or *retired*.
- While over its lease, the pool *keeps* at most ``limit`` pages that hold blocks and
  *retires* the others: the emptiest ones (most free blocks, so they empty soonest),
  never page 0 (the null block never leaves it). New requests' blocks go only into kept
  pages; a retired page takes none, and once its last block is freed it becomes ready
  (and maintenance unmaps it). So a backlog that refills every freed block cannot keep
  the pool over its lease: the retired pages empty as the requests on them finish, while
  allocation fails once the kept pages are full (the engine queues or preempts). When the
  lease rises again, or a kept page empties, retired pages go back into service, fullest
  first.
- While over its lease, blocks that grow a request the engine already runs may also
  come from the free blocks of retired pages and from ready pages the pool still holds
  (the pool's maintenance keeps enough of those for the blocks the engine says its running
  requests take in their next step). Otherwise a running request
  refused its next block is preempted and recomputed, and with one block per page there
  are no partial pages to serve it. New requests wait, so the pool still reaches its
  lease as requests finish.

Allocation is best fit: a request is served from the partial page with the fewest free
blocks that still fits it (pages with the fewest free blocks are filled first otherwise),
then from ready pages; so pages fill up densely and empty pages appear where they can be
unmapped. Partial pages sit in buckets by free count, indexed by a bit mask, so the choice
costs a few integer operations; block ids live in per-page free lists (no per-block
objects).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshare.runtime.errors import InvalidBlockError
from kvshare.runtime.geometry import KVGeometry

__all__ = ["DEFAULT_RESERVE_BLOCKS", "NULL_BLOCK", "Exhausted", "PageBlocks", "reserve_pages_for"]

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""The block id the pool reserves at start and never hands out (vLLM's null block, SGLang's
padding slot)."""

_FREE, _ALLOCATED, _NEVER = 0, 1, 2  # block states (_NEVER: null block or straddling id)


#: KV blocks' worth of ready pages a pool keeps mapped by default. The reserve is there so
#: that an engine's next blocks need not wait for a page to be mapped; an engine takes its
#: memory in blocks whatever a page holds, so the reserve is counted in blocks: four pages
#: of one 2 MiB block each, one page of eight blocks (Qwen3-8B's 18 MiB pages). Four pages
#: of eight blocks would keep 32 blocks idle in every pool, memory no other engine can use.
DEFAULT_RESERVE_BLOCKS = 4


def reserve_pages_for(geometry: KVGeometry, blocks: int = DEFAULT_RESERVE_BLOCKS) -> int:
    """The whole pages of ``geometry`` that hold ``blocks`` blocks: a pool's default
    reserve of ready pages (:data:`DEFAULT_RESERVE_BLOCKS`)."""
    per_page = max(1, geometry.page_bytes // geometry.block_bytes_all_buffers)
    return -(-blocks // per_page)


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


class PageBlocks:
    """The free blocks of a pool's published (mapped) pages. See the module docstring.

    ``wake`` asks the pool's maintenance to run (a ready page was taken below the
    ``reserve_pages``, or one appeared that may be given back).
    """

    def __init__(self, geometry: KVGeometry, reserve_pages: int, wake: Callable[[], None]) -> None:
        self.geometry = geometry
        self._reserve_pages = reserve_pages
        self._wake = wake
        self._block_bytes = geometry.block_bytes
        self._page_size = geometry.page_size
        num_pages = geometry.num_pages
        self.cap = [len(geometry.blocks_of(p)) for p in range(num_pages)]
        """Usable block ids of every page."""
        self.max_cap = max(self.cap)
        self.min_cap = min((c for c in self.cap[1:] if c), default=0)
        """Fewest blocks a page other than page 0 brings: what a page counts for."""
        self._state = bytearray(geometry.num_blocks)
        self._warn_about_waste()
        self._mark_straddling_blocks()
        self._fl: list[list[int]] = [[] for _ in range(num_pages)]
        self._published = bytearray(num_pages)  # 1: the page's blocks are in this book
        self._buckets: list[dict[int, None]] = [{} for _ in range(self.max_cap + 1)]
        self._mask = 0  # bit k set <=> _buckets[k] is not empty
        self.ready: dict[int, None] = {}
        """Empty published pages kept ahead of demand."""
        self.retiring: dict[int, None] = {}
        """Published pages given up while over the lease: no new blocks, unmapped once empty."""
        self.planned_for = -1
        """The limit (pages) the retired set was chosen for."""
        self.free_partial = 0  # free blocks in partial pages
        self.ready_blocks = 0  # free blocks in ready pages
        self.retired_free = 0  # free blocks in retired pages (for running requests only)
        self.used_blocks = 0

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
        usable = bytearray(len(self._state))
        for page in range(self.geometry.num_pages):
            blocks = self.geometry.blocks_of(page)
            usable[blocks.start : blocks.stop] = b"\x01" * len(blocks)
        for block, ok in enumerate(usable):
            if not ok:
                self._state[block] = _NEVER

    # --- pages joining and leaving -------------------------------------------------------

    def publish(self, page: int) -> None:
        """A freshly mapped page joins."""
        self._published[page] = 1
        blocks = self.geometry.blocks_of(page)
        fl = list(range(blocks.stop - 1, blocks.start - 1, -1))  # lowest ids come out first
        if page == 0:
            fl.pop()  # block 0: the null block, allocated for good
            self._state[NULL_BLOCK] = _NEVER
        self._fl[page] = fl
        if len(fl) == self.cap[page]:
            self.ready[page] = None
            self.ready_blocks += len(fl)
        elif fl:
            self._buckets[len(fl)][page] = None
            self._mask |= 1 << len(fl)
            self.free_partial += len(fl)

    def take_ready_pages(self, count: int) -> list[int]:
        """Take the highest ``count`` ready pages out (to be unmapped)."""
        if count <= 0:
            return []
        pages = sorted(self.ready, reverse=True)[:count]
        for page in pages:
            del self.ready[page]
            self.ready_blocks -= len(self._fl[page])
            self._fl[page] = []
            self._published[page] = 0
        return pages

    # --- counting ------------------------------------------------------------------------

    def free_for(self, running: bool, over: bool) -> int:
        """Free blocks an allocation may take without mapping a page: those of partial
        pages; of ready pages unless the pool is ``over`` its lease and the blocks are not
        for ``running`` requests; and for running requests those of retired pages. The
        retired set must be planned for the current limit (:meth:`plan`)."""
        if running:
            return self.free_partial + self.retired_free + self.ready_blocks
        if not over:
            return self.free_partial + self.ready_blocks
        return self.free_partial

    # --- taking blocks -------------------------------------------------------------------

    def take(self, n: int, running: bool, over: bool) -> list[int]:
        """Hand out ``n`` blocks, best fit (for ``running`` requests, retired pages before
        ready ones). The caller checked that enough are free (:meth:`free_for`)."""
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
            elif running and self.retired_free:
                remaining -= self._take_retired(remaining, out)
                continue
            else:
                remaining -= self._take_ready(remaining, out, over)
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
            self.free_partial -= take
            remaining -= take
        state = self._state
        for block in out:
            state[block] = _ALLOCATED
        self.used_blocks += n
        return out

    def _take_retired(self, wanted: int, out: list[int]) -> int:
        """Take blocks from the retired page with the fewest free ones (the one least
        likely to empty soon); returns how many."""
        fls = self._fl
        page = min((p for p in self.retiring if fls[p]), key=lambda p: len(fls[p]))
        fl = fls[page]
        take = min(wanted, len(fl))
        out += fl[-1 : -take - 1 : -1]
        del fl[-take:]
        self.retired_free -= take
        return take

    def _take_ready(self, wanted: int, out: list[int], over: bool) -> int:
        """Start using the lowest ready page; returns how many blocks were taken."""
        page = min(self.ready)
        del self.ready[page]
        if over:
            self.planned_for = -1  # over the lease: the page joins those kept, re-plan
        fl = self._fl[page]
        self.ready_blocks -= len(fl)
        take = min(wanted, len(fl))
        out += fl[-1 : -take - 1 : -1]
        del fl[-take:]
        if fl:
            self._buckets[len(fl)][page] = None
            self._mask |= 1 << len(fl)
            self.free_partial += len(fl)
        if len(self.ready) < self._reserve_pages:
            self._wake()
        return take

    # --- giving blocks back --------------------------------------------------------------

    def free(self, ids: Sequence[int], over: bool) -> None:
        """Give allocated blocks back. All or nothing: a block that is not allocated (a
        double free, the null block, an unknown id) raises :class:`InvalidBlockError` and
        frees nothing. ``over``: the pool holds more than its lease."""
        state = self._state
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
        self._return_blocks(ids, over)

    def _return_blocks(self, ids: Sequence[int], over: bool) -> None:
        """Put freed blocks back into their pages' free lists."""
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
        cap = self.cap
        mask = self._mask
        wake = False
        retiring = self.retiring
        for page, old in before.items():
            if page in retiring:  # out of service: it only waits to empty
                self.retired_free += len(fls[page]) - old
                if len(fls[page]) == cap[page]:
                    self.retired_free -= cap[page]
                    del retiring[page]
                    self.ready[page] = None  # dropped by maintenance while over the lease
                    self.ready_blocks += cap[page]
                    wake = True
                continue
            if old:
                bucket = buckets[old]
                del bucket[page]
                if not bucket:
                    mask &= ~(1 << old)
            new = len(fls[page])
            if new == cap[page]:  # empty: a ready page now (page 0 never: it keeps block 0)
                self.ready[page] = None
                self.ready_blocks += new
                self.free_partial -= old
                wake = True
            else:
                buckets[new][page] = None
                mask |= 1 << new
                self.free_partial += new - old
        self._mask = mask
        self.used_blocks -= len(ids)
        if wake and (len(self.ready) > self._reserve_pages or over):
            self._wake()

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

    # --- retirement ----------------------------------------------------------------------

    def plan(self, limit: int, mapped_pages: int) -> None:
        """Retire or restore pages so that at most ``limit`` pages holding blocks stay in
        service (see the module docstring)."""
        self.planned_for = limit
        kept = mapped_pages - len(self.ready) - len(self.retiring)
        if kept > limit:
            self._retire(kept - limit)
        elif kept < limit and self.retiring:
            self._restore(limit - kept)

    def _retire(self, count: int) -> None:
        """Take the ``count`` emptiest pages in service (never page 0) out of it: partial
        pages with the most free blocks first, then full pages."""
        buckets = self._buckets
        chosen: list[int] = []
        for free in range(self.max_cap, 0, -1):
            if len(chosen) == count:
                break
            bucket = buckets[free]
            for page in sorted(bucket, reverse=True):
                if len(chosen) == count:
                    break
                if page:
                    del bucket[page]
                    self.free_partial -= free
                    self.retired_free += free
                    chosen.append(page)
            if not bucket:
                self._mask &= ~(1 << free)
        retiring, ready, fls, published = self.retiring, self.ready, self._fl, self._published
        for page in range(len(published) - 1, 0, -1):  # full pages, highest first
            if len(chosen) == count:
                break
            full = published[page] and not fls[page]
            if full and page not in ready and page not in retiring:
                chosen.append(page)
        retiring.update(dict.fromkeys(chosen))

    def _restore(self, count: int) -> None:
        """Put up to ``count`` retired pages back into service, fullest first."""
        fls = self._fl
        for page in sorted(self.retiring, key=lambda p: len(fls[p]))[:count]:
            del self.retiring[page]
            free = len(fls[page])
            if free:
                self._buckets[free][page] = None
                self._mask |= 1 << free
                self.free_partial += free
                self.retired_free -= free
