"""What a trace allows: the same schedulers over partitions, over one shared pool, and over
pages shared first come, first served."""

from __future__ import annotations

import pytest

from kvshare.demo import trace
from kvshare.demo.bound import _PagePool, paged_sharing, sharing_bound
from kvshare.demo.trace import TraceConfig


def test_one_model_gets_the_same_from_a_partition_and_a_pool() -> None:
    alone = trace.generate(TraceConfig(duration_s=8, models=1, gpu_memory_bytes=2**30))
    bound = sharing_bound(alone)
    assert bound.partitioned == bound.shared and bound.ratio == 1.0


def test_staggered_bursts_are_served_better_by_one_shared_pool() -> None:
    config = TraceConfig(duration_s=12, models=3, gpu_memory_bytes=2 * 2**30, seed=1)
    bursty = trace.generate(config)
    bound = sharing_bound(bursty)
    assert len(bound.partitioned) == len(bound.shared) == 3
    assert sum(bound.shared) > sum(bound.partitioned) > 0
    assert sum(bound.shared) <= len(bursty.requests)
    assert bound.ratio > 1
    assert sharing_bound(bursty) == bound  # no clock, no randomness: the same every time


def test_pages_of_one_block_share_exactly_as_the_shared_pool_does() -> None:
    bursty = trace.generate(TraceConfig(duration_s=12, models=3, gpu_memory_bytes=2**31, seed=1))
    assert paged_sharing(bursty, 1) == sharing_bound(bursty).shared


def test_coarser_pages_serve_less_than_the_shared_pool_and_each_model_keeps_its_pages() -> None:
    bursty = trace.generate(TraceConfig(duration_s=12, models=3, gpu_memory_bytes=2**31, seed=1))
    bound = sharing_bound(bursty)
    assert sum(paged_sharing(bursty, 64)) < sum(bound.shared)


def test_a_page_goes_back_to_the_gpu_only_when_its_last_block_is_freed() -> None:
    pool = _PagePool(pages=2, blocks_per_page=4, models=2)
    a, b = pool.view(0), pool.view(1)
    first = a.alloc(3)
    assert first is not None and len({(block - 1) // 4 for block in first}) == 1
    second = b.alloc(4)
    assert second is not None
    assert b.alloc(1) is None  # both pages are held: one by each model
    a.free(first[:2])
    assert b.alloc(1) is None  # a's page still holds a block in use
    assert a.alloc(3) is not None  # a refills its own page (three blocks free there)
    a.free(first[2:])
    assert b.alloc(1) is None
    b.free(second)  # b's page goes back: a takes it with the free block of its own
    assert a.alloc(5) is not None and a.alloc(1) is None


def test_pages_must_hold_a_block() -> None:
    with pytest.raises(ValueError, match="blocks_per_page must be >= 1"):
        paged_sharing(trace.generate(TraceConfig(duration_s=2, models=1)), 0)
