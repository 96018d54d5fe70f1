"""Random alloc/free/grow/shrink sequences against a pool on real host virtual memory.

After every step: no block is handed out twice, every page is mapped at most once and
exactly the pages the pool accounts for are mapped, the pool never grows beyond its
lease, the engine's data in blocks in use is intact, after a maintenance pass every
free page beyond the reserve is unmapped, and while the pool is over its lease it places
new requests' blocks in no more pages than the lease covers (so the other pages can
empty) and keeps no more empty pages than its running requests' next blocks need. Blocks
the pool counts as available can always be taken (an engine counts, then takes).
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.errors import InvalidBlockError
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pool import NULL_BLOCK, KVPool

from .support import MovableLease, PrefixCache

PAGE = 16384
# 4 blocks of 4 KiB per page and buffer (per-layer, 2 buffers): 18 blocks = 5 pages, the
# last one partly outside the blocks.
GEOMETRY = KVGeometry(num_buffers=2, block_bytes=4096, num_blocks=18, page_size=PAGE)
PAGE_BYTES = GEOMETRY.page_bytes
RESERVE = 2
#: Fewest blocks a page other than page 0 holds: the spare pages' unit.
MIN_CAP = min(c for c in (len(GEOMETRY.blocks_of(p)) for p in range(1, GEOMETRY.num_pages)) if c)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = HostBackend()
        self.lease = MovableLease(3 * PAGE_BYTES)
        self.pool = KVPool(
            GEOMETRY, self.backend, self.lease, reserve_pages=RESERVE, background=False
        )
        self.cache = PrefixCache(self.pool)
        self.pool.set_evictor(self.cache)
        self.in_use: set[int] = set()
        self.running = 0  # requests the engine says it runs
        # Blocks allocated while the pool was over its current lease (reset when it moves).
        self.placed_while_over: set[int] = set()
        self.view = self.pool.tensor(0, 2)
        self.held_before = self.pool.snapshot().held

    def teardown(self) -> None:
        self.pool.close()

    def _mark(self, block: int) -> int:
        return block * 7 % 251

    @rule(n=st.integers(min_value=1, max_value=9), running=st.booleans())
    def alloc(self, n: int, running: bool) -> None:
        before = self.pool.snapshot()
        ids = self.pool.alloc(n, running=running)
        if not ids:
            return
        self._took(ids, n, over=before.held > before.limit and not running)

    @rule(running=st.booleans())
    def counted_blocks_can_be_taken(self, running: bool) -> None:
        before = self.pool.snapshot()
        n = self.pool.available(running=running)
        if n:
            ids = self.pool.alloc(n, running=running)
            assert ids, f"{n} blocks counted available were refused: {ids!r}"
            self._took(ids, n, over=before.held > before.limit and not running)

    @rule(count=st.integers(min_value=0, max_value=5))
    def engine_runs(self, count: int) -> None:
        self.pool.expect_blocks(count)
        self.running = count

    def _took(self, ids: list[int], n: int, *, over: bool) -> None:
        if over:
            self.placed_while_over |= set(ids)
        assert len(ids) == n == len(set(ids))
        assert NULL_BLOCK not in ids
        assert not set(ids) & (self.in_use | set(self.cache.blocks))
        for block in ids:
            self.view[:, block, :8] = self._mark(block)
        self.in_use |= set(ids)

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), unique=True, min_size=1))
        self.pool.free(chosen)
        self.in_use -= set(chosen)
        self.placed_while_over -= set(chosen)

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def keep_as_cache(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.in_use)))
        self.in_use.discard(block)
        self.cache.blocks.append(block)

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.in_use)))
        before = self.pool.snapshot()
        self.pool.free([block])
        try:
            self.pool.free([block])
        except InvalidBlockError:
            pass
        else:
            raise AssertionError("a double free was accepted")
        assert self.pool.snapshot().used_blocks == before.used_blocks - 1
        self.in_use.discard(block)
        self.placed_while_over.discard(block)

    @rule(pages=st.integers(min_value=0, max_value=6))
    def move_lease(self, pages: int) -> None:
        self.lease.set_limit(pages * PAGE_BYTES)
        self.placed_while_over.clear()

    @rule()
    def maintain(self) -> None:
        self.pool.maintain()
        snap = self.pool.snapshot()
        pages_in_use = {GEOMETRY.page_of(b) for b in self.in_use} | {0}
        if snap.held > snap.limit:  # still over the lease: pages with live blocks stay,
            assert not self.cache.blocks  # and empty ones for the running requests' next blocks
            spare = self.pool.mapped_pages() - pages_in_use
            assert pages_in_use <= self.pool.mapped_pages()
            assert len(spare) <= -(-self.running // MIN_CAP)
        else:  # every free page beyond the reserve is unmapped
            assert snap.ready <= RESERVE * PAGE_BYTES

    @invariant()
    def no_growth_beyond_the_lease(self) -> None:
        held = self.pool.snapshot().held
        assert held <= max(self.held_before, self.lease.limit()), "grew beyond the lease"
        self.held_before = held

    @invariant()
    def while_over_the_lease_new_blocks_stay_within_as_many_pages_as_it_covers(self) -> None:
        snap = self.pool.snapshot()
        if snap.held > snap.limit:
            # Page 0 (the null block's) always stays in service, so it is always counted.
            pages = {GEOMETRY.page_of(b) for b in self.placed_while_over} | {0}
            assert len(pages) * PAGE_BYTES <= max(snap.limit, PAGE_BYTES)

    @invariant()
    def mapped_pages_are_exactly_the_pools(self) -> None:
        mapped = self.backend.mapped_ranges()
        per_page = len(GEOMETRY.page_chunks(0))
        assert len(mapped) == per_page * len(self.pool.mapped_pages())
        snap = self.pool.snapshot()
        assert snap.mapped == sum(mapped.values())
        assert snap.used_blocks == len(self.in_use) + len(self.cache.blocks)

    @invariant()
    def blocks_in_use_keep_their_data(self) -> None:
        mapped = self.pool.mapped_pages()
        for block in self.in_use | set(self.cache.blocks):
            assert GEOMETRY.page_of(block) in mapped
            assert torch.all(self.view[:, block, :8] == self._mark(block))


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPoolStateMachine = PoolMachine.TestCase


def test_a_pass_that_reaches_a_lowered_lease_trims_the_ready_pages_to_the_reserve() -> None:
    # Found by the machine above: with five requests running and the lease lowered by one
    # page, the pass dropped that one page and kept three empty pages mapped within the
    # lease, the spare pages the running requests get only while the pool is over it.
    lease = MovableLease(5 * PAGE_BYTES)
    pool = KVPool(GEOMETRY, HostBackend(), lease, reserve_pages=RESERVE, background=False)
    try:
        ids: list[int] = []
        while pool.available():  # every page mapped, full
            taken = pool.alloc(pool.available())
            assert isinstance(taken, list)
            ids += taken
        assert pool.snapshot().held == 5 * PAGE_BYTES
        pool.expect_blocks(5)
        pool.free([b for b in ids if GEOMETRY.page_of(b) != 0])
        lease.set_limit(4 * PAGE_BYTES)
        pool.maintain()
        snap = pool.snapshot()
        assert snap.held <= snap.limit
        assert snap.ready <= RESERVE * PAGE_BYTES
    finally:
        pool.close()
