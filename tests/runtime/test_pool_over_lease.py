"""A KV pool over its lease, on real host virtual memory: running requests keep growing,
new ones wait, retired pages empty and the lease is reached."""

from __future__ import annotations

from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pool import KVPool

from .conftest import PoolFactory
from .support import MovableLease

PAGE = 64 * 1024


def test_while_over_its_lease_the_pool_grows_running_requests_from_its_empty_pages(
    make_pool: PoolFactory,
) -> None:
    """One block per page (a block-outer layout): a pool over its lease has no partial
    pages to serve from. Running requests still grow into the pages that finished ones
    emptied, one page kept per request the engine runs, while new requests wait; once the
    running requests finish the pages go back and the lease is reached."""
    one_block_pages = KVGeometry(num_buffers=4, block_bytes=PAGE, num_blocks=32, page_size=PAGE)
    page_bytes = one_block_pages.page_bytes
    lease = MovableLease(8 * page_bytes)
    pool = make_pool(one_block_pages, lease=lease, reserve_pages=0)
    requests = [pool.alloc(1) for _ in range(7)]  # pages 1-7 (page 0: the null block)
    assert all(requests)
    lease.set_limit(4 * page_bytes)
    for finished in requests[:3]:
        pool.free(finished)  # three pages empty, not yet given back
    pool.expect_blocks(2)  # two of the four left still decode
    pool.maintain()
    # One empty page per running request stays (and page 0); nothing beyond the lease maps.
    snap = pool.snapshot()
    assert snap.ready == 2 * page_bytes and snap.held == 7 * page_bytes
    assert not pool.alloc(1), "a new request was admitted while the pool is over its lease"
    assert pool.available() == 0 and pool.available(running=True) == 2
    grown = pool.alloc(1, running=True)
    assert grown, "a running request was refused a block the pool holds empty"
    pool.expect_blocks(0)
    for block_ids in [*requests[3:], grown]:
        pool.free(block_ids)
    pool.maintain()
    snap = pool.snapshot()
    assert snap.held <= snap.limit == 4 * page_bytes


def two_full_pages_of_eight_blocks(make_pool: PoolFactory) -> tuple[KVPool, MovableLease, int]:
    """A pool of eight-block pages, its lease four pages, whose pages 0 (around the null
    block) and 1 are full; with its lease and its page size."""
    eight_block_pages = KVGeometry(
        num_buffers=4, block_bytes=PAGE // 8, num_blocks=64, page_size=PAGE
    )
    lease = MovableLease(4 * eight_block_pages.page_bytes)
    pool = make_pool(eight_block_pages, lease=lease, reserve_pages=0)
    assert pool.alloc(7) and pool.alloc(8)
    return pool, lease, eight_block_pages.page_bytes


def test_a_pool_over_its_lease_counts_only_the_blocks_it_will_hand_out(
    make_pool: PoolFactory,
) -> None:
    """A running request grew into an emptied page, which rejoins the pages in service;
    the pool is still over its lease, so that page is retired again at the next
    allocation. An engine counts free blocks and then takes them (vLLM cannot fail in
    between): the count already leaves out the retired page's blocks."""
    pool, lease, page_bytes = two_full_pages_of_eight_blocks(make_pool)
    finishing = pool.alloc(8)  # page 2
    assert finishing
    lease.set_limit(2 * page_bytes)
    pool.free(finishing)
    pool.expect_blocks(1)
    pool.maintain()
    assert pool.alloc(1, running=True), "the running request was refused the empty page"
    counted = pool.available()
    assert counted == 0, f"{counted} blocks counted free on a page the pool retires"
    assert not pool.alloc(1)


def test_while_over_its_lease_running_requests_grow_into_the_free_blocks_of_retired_pages(
    make_pool: PoolFactory,
) -> None:
    """A retired page half emptied by a finished request takes no new request, but a
    running request's next blocks: they are mapped memory the pool cannot give back
    before the page's other request finishes anyway."""
    pool, lease, page_bytes = two_full_pages_of_eight_blocks(make_pool)
    finishing, staying = pool.alloc(4), pool.alloc(4)  # page 2, full
    assert finishing and staying
    lease.set_limit(2 * page_bytes)
    assert pool.available() == 0  # page 2 is retired: over the lease, full pages only
    pool.free(finishing)
    pool.expect_blocks(3)
    assert not pool.alloc(1), "a new request was admitted while the pool is over its lease"
    assert pool.available(running=True) == 4
    grown = pool.alloc(3, running=True)
    assert grown and {pool.geometry.page_of(b) for b in grown} == {2}
    assert pool.available(running=True) == 1
    pool.expect_blocks(0)
    for block_ids in (staying, grown):
        pool.free(block_ids)
    pool.maintain()
    snap = pool.snapshot()
    assert snap.held <= snap.limit == 2 * page_bytes
