"""The KV pool on real host virtual memory: block ids for the engine, pages that follow use,
and a lease it never grows beyond."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvshare.runtime import pool as pool_module
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.errors import InvalidBlockError, PoolClosedError, PoolError
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import NULL_BLOCK, Exhausted, KVPool

from .conftest import PoolFactory
from .support import MovableLease, PrefixCache, wait_until

PAGE = 64 * 1024
# 2 layers x K/V, 16 blocks of 4 KiB per 64 KiB page, 256 blocks = 16 pages.
GEOMETRY = KVGeometry(num_buffers=4, block_bytes=4096, num_blocks=256, page_size=PAGE)
PAGE_BYTES = GEOMETRY.page_bytes


def host(pool: KVPool) -> HostBackend:
    assert isinstance(pool.backend, HostBackend)
    return pool.backend


def test_the_null_block_is_reserved_at_start_and_never_handed_out(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY, reserve_pages=0)
    assert pool.mapped_pages() == {0}
    handed_out: list[int] = []
    while ids := pool.alloc(7):
        handed_out += ids
    assert NULL_BLOCK not in handed_out
    assert sorted(handed_out) == list(range(1, len(handed_out) + 1))
    with pytest.raises(InvalidBlockError, match="null block"):
        pool.free([NULL_BLOCK])


def test_bad_frees_are_refused_and_free_nothing(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY)
    ids = pool.alloc(4)
    assert ids
    before = pool.snapshot()
    for bad, fragment in [
        ([ids[0], ids[0]], "not allocated"),
        ([ids[1], 10_000], "outside the pool's 256 blocks"),
        ([ids[2], -3], "null block|outside"),
        ([ids[3], "7"], "not an integer"),
    ]:
        with pytest.raises(InvalidBlockError, match=fragment):
            pool.free(bad)  # type: ignore[arg-type]
        assert pool.snapshot() == before
    pool.free(ids)
    with pytest.raises(InvalidBlockError, match="freed twice"):
        pool.free(ids[:1])


def test_exhausted_is_falsy_allocates_nothing_and_says_why(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY, lease=StaticLease(3 * PAGE_BYTES), reserve_pages=0)
    first = pool.alloc(pool.available())
    assert first and len(first) == 3 * 16 - 1
    result = pool.alloc(1)
    assert isinstance(result, Exhausted) and not result
    assert result.reason.startswith("lease:") and result.requested == 1
    assert result.available == 0
    assert pool.snapshot().used_blocks == len(first)


def test_available_is_exactly_what_alloc_can_hand_out(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY, lease=StaticLease(5 * PAGE_BYTES), reserve_pages=1)
    pool.maintain()
    held = pool.alloc(20)
    assert held
    can = pool.available()
    assert can == 5 * 16 - 1 - 20
    assert not pool.alloc(can + 1)
    assert len(pool.alloc(can) or []) == can


def test_best_fit_fills_the_fullest_page_and_freed_pages_go_back_whole(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(GEOMETRY, reserve_pages=0)
    a = pool.alloc(15)  # page 0 full (with the null block)
    b = pool.alloc(16)  # page 1 full
    c = pool.alloc(16)  # page 2 full
    assert a and b and c
    pool.free(b[:10])  # page 1: 10 free
    pool.free(c[:3])  # page 2: 3 free
    small = pool.alloc(2)  # best fit: page 2 (3 free), not page 1
    assert small and {GEOMETRY.page_of(x) for x in small} == {2}
    pool.free(b[10:])  # page 1 is empty now
    pool.maintain()  # no reserve: the empty page is unmapped at once
    assert pool.mapped_pages() == {0, 2}


def test_two_views_of_the_same_buffer_see_the_same_bytes(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY)
    ids = pool.alloc(20)
    assert ids
    kv = pool.tensor(2, 2).view(torch.float16).reshape(2, 256, 16, 128)  # layer 1: K and V
    kv[0, ids[17]] = 1.5
    kv[1, ids[17]] = -2.0
    v_alone = pool.tensor(3).view(torch.float16).reshape(256, 16, 128)
    assert torch.all(v_alone[ids[17]] == -2.0)
    k_alone = pool.tensor(2).view(torch.float16).reshape(256, 16, 128)
    assert torch.all(k_alone[ids[17]] == 1.5)
    assert torch.all(pool.tensor(0)[0, ids[17]] == 0)  # layer 0 untouched


def test_contiguous_layout_views_share_the_compound_pages(make_pool: PoolFactory) -> None:
    geometry = KVGeometry(
        num_buffers=4, block_bytes=4096, num_blocks=256, page_size=PAGE, layout="contiguous"
    )
    pool = make_pool(geometry)
    ids = pool.alloc(3)
    assert ids
    pool.tensor(1)[0, ids[2]] = 9
    whole = pool.tensor(0, 4).permute(1, 0, 2)  # (num_blocks, buffers, block_bytes)
    assert torch.all(whole[ids[2], 1] == 9)
    assert int(whole[ids[2]].sum()) == 9 * 4096


def test_freed_pages_are_unmapped_released_and_come_back_zeroed(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY, reserve_pages=0)
    baseline = host(pool).physical_bytes()  # page 0 with the null block
    ids = pool.alloc(15 + 16 * 3)  # page 0 and three more pages
    assert ids
    assert host(pool).physical_bytes() == baseline + 3 * PAGE_BYTES
    view = pool.tensor(0, 4)
    for block in ids:
        view[:, block] = 0xAB
    pool.free(ids[15:])
    pool.maintain()
    assert pool.mapped_pages() == {0}
    assert host(pool).physical_bytes() == baseline  # the memory really went back
    again = pool.alloc(16 * 3)
    assert again
    assert set(again) == set(ids[15:])
    assert int(view[:, again].sum()) == 0


def test_a_background_reserve_keeps_ready_pages_without_exceeding_the_lease(
    make_pool: PoolFactory,
) -> None:
    lease = MovableLease(4 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=6, background=True)
    wait_until(lambda: pool.snapshot().ready == 3 * PAGE_BYTES)  # limited by the lease
    snap = pool.snapshot()
    assert snap.held == 4 * PAGE_BYTES == snap.limit
    assert lease.wants, "the pool asks for more lease when it cannot fill its reserve"
    assert all(want % PAGE_BYTES == 0 for want in lease.wants)
    ids = pool.alloc(15 + 3 * 16)
    assert ids and pool.snapshot().waits == 0  # the reserve covered the whole request


@pytest.mark.parametrize(("blocks_per_page", "ready_pages"), [(1, 4), (2, 2), (3, 2), (16, 1)])
def test_the_default_reserve_holds_four_blocks_whatever_a_page_holds(
    make_pool: PoolFactory, blocks_per_page: int, ready_pages: int
) -> None:
    """Ready pages are there so that an engine's next blocks need not wait for a mapping;
    an engine takes blocks, so a pool of 16-block pages keeping four of them would hold
    64 blocks idle that no other engine can use."""
    geometry = KVGeometry(
        num_buffers=4, block_bytes=PAGE // blocks_per_page, num_blocks=256, page_size=PAGE
    )
    pool = make_pool(geometry)
    pool.maintain()
    assert pool.snapshot().ready == ready_pages * geometry.page_bytes


def test_a_lease_full_of_prefix_cache_asks_for_no_ready_pages(make_pool: PoolFactory) -> None:
    """A serving engine keeps the blocks it frees as prefix cache, so its lease fills with
    cache; it reuses cached blocks when the pool has no fresh ones, as fast as ready pages.
    A pool whose cache covers its reserve asks the broker for nothing more; one whose
    cache is gone asks again."""
    lease = MovableLease(6 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=2, lease_chunk_bytes=PAGE_BYTES)
    cache = PrefixCache(pool)
    pool.set_evictor(cache)
    in_use = pool.alloc(15 + 16)  # pages 0 and 1 in use
    cached = pool.alloc(16 * 4)  # pages 2-5 kept only as cache: the lease is full
    assert in_use and cached
    cache.blocks = list(cached)
    pool.maintain()
    assert lease.wants == []
    cache.evict(16 * 3)  # the engine reused most of its cache: one page of it is left
    pool.alloc(16 * 3)
    pool.maintain()
    assert lease.wants and lease.wants[-1] > lease.limit()


def test_pages_left_partly_empty_count_as_room_ahead(make_pool: PoolFactory) -> None:
    """Finished requests leave pages partly empty: their free blocks serve new ones as fast
    as a ready page. A pool with that much room asks for nothing more."""
    lease = MovableLease(6 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=2, lease_chunk_bytes=PAGE_BYTES)
    ids = pool.alloc(15 + 16 * 5)  # pages 0-5: the whole lease
    assert ids
    pool.free(ids[15::2])  # half of the blocks of pages 1-5 free: 2.5 pages of room
    pool.maintain()
    assert lease.wants == []
    assert pool.alloc(40)  # the room: no page needed
    pool.maintain()
    assert lease.wants and lease.wants[-1] > lease.limit()


def test_wants_come_in_chunks_and_grants_let_the_pool_grow(make_pool: PoolFactory) -> None:
    lease = MovableLease(2 * PAGE_BYTES, grant_up_to=12 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=2, lease_chunk_bytes=4 * PAGE_BYTES)
    ids = pool.alloc(100)  # needs 7 pages: beyond the lease, granted in chunks of 4 pages
    assert ids and len(ids) == 100
    assert lease.wants and all(w % (4 * PAGE_BYTES) == 0 for w in lease.wants)
    assert pool.snapshot().held <= lease.limit()


def test_a_lowered_lease_evicts_cache_unmaps_emptied_pages_and_keeps_blocks_in_use(
    make_pool: PoolFactory,
) -> None:
    lease = MovableLease(16 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=2)
    cache = PrefixCache(pool)
    pool.set_evictor(cache)
    in_use = pool.alloc(15 + 16)  # pages 0 and 1
    cached = pool.alloc(16 * 3)  # pages 2-4, kept only as cache
    assert in_use and cached
    cache.blocks = list(cached)
    view = pool.tensor(0, 4)
    for block in in_use:
        view[:, block] = block % 251
    pool.maintain()
    assert pool.snapshot().ready == 2 * PAGE_BYTES
    lease.set_limit(2 * PAGE_BYTES)
    assert not pool.alloc(1)  # stop growing: nothing new while over the lease
    pool.maintain()  # ready pages go first, then the cache is evicted, emptied pages unmapped
    assert cache.evict_calls and not cache.blocks
    snap = pool.snapshot()
    assert pool.mapped_pages() == {0, 1}
    assert snap.held == 2 * PAGE_BYTES
    assert lease.reports[-1].mapped == 2 * PAGE_BYTES
    for block in in_use:
        assert torch.all(view[:, block] == block % 251)


def test_a_lowered_lease_is_reached_under_a_backlog_that_takes_every_free_block(
    make_pool: PoolFactory,
) -> None:
    """An engine with an endless queue: each step its oldest request finishes and it admits
    new ones for as long as ``alloc`` gives blocks. Once every request that ran when the
    lease was lowered has finished, the pool is within the lease: the pages it gave up
    took no new blocks, so they emptied and were unmapped, and the engine kept serving
    from the pages it kept."""
    lease = MovableLease(8 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=0)
    rng = random.Random(7)
    view = pool.tensor(0, 4)
    running: list[tuple[list[int], int]] = []  # (blocks, the mark written into them)
    marks = iter(range(10**6))

    def admit() -> int:
        admitted = 0
        while ids := pool.alloc(rng.randint(1, 6)):
            mark = next(marks) % 251
            view[:, ids] = mark
            running.append((ids, mark))
            admitted += 1
        return admitted

    admit()
    assert pool.snapshot().held == 8 * PAGE_BYTES
    lease.set_limit(4 * PAGE_BYTES)
    old_requests = len(running)
    served_while_shrinking = 0
    for _ in range(old_requests):
        done, mark = running.pop(0)
        assert torch.all(view[:, done] == mark)  # never moved or unmapped under it
        pool.free(done)
        served_while_shrinking += admit()
        pool.maintain()
        assert pool.snapshot().held <= 8 * PAGE_BYTES
    snap = pool.snapshot()
    assert snap.held <= snap.limit == 4 * PAGE_BYTES
    assert host(pool).physical_bytes() <= 4 * PAGE_BYTES
    assert served_while_shrinking > 0, "the kept pages went on serving the queue"
    assert lease.reports[-1].held <= 4 * PAGE_BYTES


class GatedHostBackend(HostBackend):
    """Host memory whose page creation waits at a gate the test opens (so a test can catch
    the reserve thread in the middle of creating pages)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def create(self, size: int) -> int:
        self.entered.set()
        self.gate.wait(30)
        return super().create(size)


def test_pages_the_reserve_is_creating_serve_an_allocation_instead_of_a_refusal() -> None:
    """Real host memory; only the moment page creation finishes is held back (a gate, as a
    slow device would), so the allocation surely comes while the reserve's pages are on
    their way."""
    backend = GatedHostBackend()
    lease = StaticLease(3 * PAGE_BYTES)
    pool = KVPool(GEOMETRY, backend, lease, reserve_pages=2, background=False)
    try:
        backend.gate.clear()
        backend.entered.clear()
        reserve = threading.Thread(target=pool.maintain)  # refills the reserve: 2 pages
        reserve.start()
        assert backend.entered.wait(30)
        result: list[object] = []
        # Page 0's 15 blocks and 20 more: the two pages on their way are the only room left.
        engine = threading.Thread(target=lambda: result.append(pool.alloc(15 + 20)))
        engine.start()
        wait_until(lambda: pool.snapshot().allocations == 1)  # it asked, the pages are not there
        backend.gate.set()
        engine.join(30)
        reserve.join(30)
        ids = result[0]
        assert isinstance(ids, list) and len(ids) == 35, ids
        assert pool.snapshot().held == 3 * PAGE_BYTES
    finally:
        pool.close()


def test_pages_in_flight_for_longer_than_every_wait_still_serve_the_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine counted these blocks as free (``available``) before asking; vLLM has no
    way to fail a block it counted. Page creation is held back for many times the pool's
    longest wait for pages in flight (scaled down here), as a peer rank busy with a long
    step holds it back, and the allocation still gets the pages once they come."""
    monkeypatch.setattr(pool_module, "_IN_FLIGHT_WAIT_S", 0.02)
    backend = GatedHostBackend()
    lease = StaticLease(3 * PAGE_BYTES)
    pool = KVPool(GEOMETRY, backend, lease, reserve_pages=2, background=False)
    try:
        promised = pool.available()  # page 0's blocks and the two pages the lease allows
        backend.gate.clear()
        backend.entered.clear()
        # Between counting and asking, the reserve starts creating those two pages.
        reserve = threading.Thread(target=pool.maintain)
        reserve.start()
        assert backend.entered.wait(30)
        result: list[object] = []
        engine = threading.Thread(target=lambda: result.append(pool.alloc(promised)))
        engine.start()
        time.sleep(0.02 * pool_module._ALLOC_ROUNDS * 10)  # ten times every round's wait
        backend.gate.set()
        engine.join(30)
        reserve.join(30)
        ids = result[0]
        assert isinstance(ids, list) and len(ids) == promised == 15 + 2 * 16, ids
    finally:
        pool.close()


def test_alloc_never_maps_beyond_the_lease(make_pool: PoolFactory) -> None:
    lease = MovableLease(6 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=3)
    held: list[int] = []
    for step in range(60):
        ids = pool.alloc(1 + step % 9)
        if ids:
            held += ids
        if step % 4 == 3:
            pool.free(held[: len(held) // 3])
            held = held[len(held) // 3 :]
        pool.maintain()
        assert sum(host(pool).mapped_ranges().values()) <= lease.limit()


def test_close_gives_everything_back_and_is_idempotent() -> None:
    backend = HostBackend()
    lease = MovableLease(2**30)
    pool = KVPool(GEOMETRY, backend, lease, reserve_pages=2, background=True)
    assert pool.alloc(40)
    pool.close()
    pool.close()
    assert lease.closed and lease.reports[-1].held == 0
    with pytest.raises(PoolClosedError):
        pool.alloc(1)


def test_a_lease_below_one_page_is_a_clear_start_up_error() -> None:
    with pytest.raises(PoolError, match="does not cover one page"):
        KVPool(GEOMETRY, HostBackend(), StaticLease(PAGE_BYTES - 1), lease_timeout_s=0.1)


def test_a_pool_waiting_for_the_page_of_its_null_block_says_its_ask_again() -> None:
    """A broker lets an ask it has not heard for a while lapse (a pool still short says so
    again): the first page a pool without a minimum waits for is asked for again every
    retry, or a broker that could not grant it at once never would."""
    lease = MovableLease(0)
    started: list[KVPool] = []
    starting = threading.Thread(
        target=lambda: started.append(
            KVPool(GEOMETRY, HostBackend(), lease, reserve_pages=0, lease_timeout_s=10)
        ),
        daemon=True,
    )
    starting.start()
    wait_until(lambda: len(lease.wants) >= 3, what="the pool to say its ask again")
    assert len(set(lease.wants)) == 1 and lease.wants[0] >= PAGE_BYTES  # the same ask
    lease.set_limit(PAGE_BYTES)
    starting.join(5)
    assert started, "the pool did not start once its page was granted"
    started[0].close()


def test_threads_allocating_freeing_and_moving_the_lease_never_share_a_block(
    make_pool: PoolFactory,
) -> None:
    lease = MovableLease(8 * PAGE_BYTES, grant_up_to=12 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease=lease, reserve_pages=2, background=True)
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()
    failures: list[BaseException] = []
    stop = threading.Event()
    ops = [0] * 4

    def engine_thread(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[list[int]] = []
        try:
            while not stop.is_set():
                ops[seed] += 1
                if mine and rng.random() < 0.5:
                    ids = mine.pop(rng.randrange(len(mine)))
                    with owners_lock:
                        for block in ids:
                            assert owners.pop(block) == seed
                    pool.free(ids)
                elif ids := pool.alloc(rng.randint(1, 12)):
                    with owners_lock:
                        for block in ids:
                            assert block not in owners, f"block {block} handed out twice"
                            owners[block] = seed
                    mine.append(ids)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=engine_thread, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for step in range(40):
        lease.set_limit((3 + step % 9) * PAGE_BYTES)
        time.sleep(0.005)
    stop.set()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert min(ops) > 100
    pool.maintain()
    snap = pool.snapshot()
    assert snap.used_blocks == len(owners)
    assert sum(host(pool).mapped_ranges().values()) == snap.mapped


def test_an_engine_short_of_blocks_makes_the_pool_ask_for_lease_without_an_alloc(
    make_pool: PoolFactory,
) -> None:
    # vLLM compares what a request needs with available() and, when it is short, does not
    # call alloc at all: the pool must still ask for the lease it lacks.
    lease = MovableLease(2 * PAGE_BYTES)
    pool = make_pool(GEOMETRY, lease, reserve_pages=0, lease_chunk_bytes=PAGE_BYTES)
    held = pool.alloc(pool.available())
    assert held and pool.available() == 0
    pool.short_of(20)  # more than one page of 16 blocks
    assert lease.wants == [4 * PAGE_BYTES]  # both pages held, two more for 20 blocks
    pool.short_of(20)
    assert lease.wants == [4 * PAGE_BYTES]  # asked once for that much
    lease.set_limit(PAGE_BYTES)  # a reclaim: shrinking, the pool asks for nothing
    pool.short_of(20)
    assert lease.wants == [4 * PAGE_BYTES]


def test_a_reclaimed_pool_asks_again_for_as_much_only_after_the_retry_interval(
    make_pool: PoolFactory,
) -> None:
    # The hold-off damps a reclaim followed at once by the same ask (see KVPool._want): the
    # broker took the memory for a pool that is short, and an immediate ask would contend
    # for it again.
    now = [100.0]
    lease = MovableLease(2 * PAGE_BYTES, grant_up_to=4 * PAGE_BYTES)
    pool = make_pool(
        GEOMETRY, lease, reserve_pages=0, lease_chunk_bytes=PAGE_BYTES, clock=lambda: now[0]
    )
    held = pool.alloc(pool.available())
    assert held
    pool.short_of(20)
    assert lease.wants == [4 * PAGE_BYTES] and lease.limit() == 4 * PAGE_BYTES
    lease.set_limit(2 * PAGE_BYTES)  # reclaimed before it used the grant
    pool.maintain()
    assert pool.snapshot().held == 2 * PAGE_BYTES
    now[0] += pool_module._WANT_RETRY_S / 2
    pool.short_of(20)
    assert lease.wants == [4 * PAGE_BYTES]  # held off
    pool.short_of(40)
    assert lease.wants == [4 * PAGE_BYTES, 5 * PAGE_BYTES]  # a larger need is said at once
    now[0] += pool_module._WANT_RETRY_S * 1.01
    lease.set_limit(2 * PAGE_BYTES)
    pool.maintain()
    pool.short_of(20)
    assert lease.wants[-1] == 4 * PAGE_BYTES and len(lease.wants) == 3


def test_a_blocks_address_is_where_its_tensor_view_keeps_it(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY, StaticLease(4 * PAGE_BYTES))
    (block,) = pool.alloc(1)  # type: ignore[misc]
    view = pool.tensor(2)[0]
    assert pool.block_address(2, block) == view[block].data_ptr()
    with pytest.raises(ValueError, match="outside the pool's 256 blocks"):
        pool.block_address(0, 256)


def test_the_expected_block_count_is_checked(make_pool: PoolFactory) -> None:
    pool = make_pool(GEOMETRY)
    with pytest.raises(ValueError, match="expected blocks must be >= 0"):
        pool.expect_blocks(-1)
