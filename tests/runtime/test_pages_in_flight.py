"""Pages on their way out of a pool (emptied while an engine step runs, waiting for it
before they are unmapped) still count and serve: the engine never sees fewer free blocks
for an instant after freeing some, and a block it counted is a block it gets."""

from __future__ import annotations

from kvshare.runtime.geometry import KVGeometry

from .conftest import PoolFactory

# 16 blocks of 4 KiB per 64 KiB page (block-outer: one buffer), 256 blocks = 16 pages.
GEOMETRY = KVGeometry(num_buffers=1, block_bytes=4096, num_blocks=256, page_size=64 * 1024)


def test_a_page_emptied_during_a_step_counts_and_serves_before_the_step_ends(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(GEOMETRY, reserve_pages=0)
    everything = pool.available()  # 255: every block but the null block
    first = pool.alloc(15 + 16)  # pages 0 and 1
    assert first and pool.mapped_pages() == {0, 1}
    pool.steps.scheduled()  # a step that may still read page 1's blocks is in flight
    pool.free(first[15:])  # page 1 empties
    pool.maintain()  # picked to be unmapped; waits for the step
    assert pool.available() == everything - 15  # as vLLM counts: freed blocks are free
    again = pool.alloc(everything - 15)  # every block the engine was told it could have
    assert again, again
    assert 1 in pool.mapped_pages()  # taken back into service, never unmapped
    pool.steps.finished()
    pool.maintain()
    assert pool.mapped_pages() == set(range(16))  # nothing left to unmap: all in use
    pool.free(first[:15] + again)
    pool.maintain()
    assert pool.mapped_pages() == {0}
