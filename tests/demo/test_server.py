"""The model server's parts: its pool geometry, the reclaim counter, the block stamps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvshare.demo.server import DemoConfigError, ReclaimCounter, StampedBlocks, demo_geometry
from kvshare.demo.trace import TraceConfig
from kvshare.runtime.backends import open_backend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

GIB = 2**30
OS_PAGE = 4096


@pytest.mark.parametrize(("gpu", "page"), [(4 * GIB, 256 * 2**10), (2 * GIB, 128 * 2**10)])
def test_pages_scale_with_the_gpu_so_they_are_never_coarse(gpu: int, page: int) -> None:
    geometry = demo_geometry(TraceConfig(gpu_memory_bytes=gpu), OS_PAGE)
    assert geometry.num_buffers == 64 and geometry.layout == "per-layer"
    assert geometry.block_bytes == 32 * 2**10  # 16 tokens x 2 KiB of one layer's K (or V)
    assert geometry.page_size == page
    assert gpu // geometry.page_bytes >= 256
    # The virtual range holds the whole GPU's worth of blocks besides the null block.
    assert (geometry.num_blocks - 1) * geometry.block_bytes * 64 >= gpu


def test_a_large_gpu_keeps_the_drivers_page_size() -> None:
    geometry = demo_geometry(TraceConfig(gpu_memory_bytes=80 * GIB), 2 * 2**20)
    assert geometry.page_size == 2 * 2**20


def test_kv_bytes_that_do_not_split_into_layers_are_refused() -> None:
    config = dataclasses.replace(TraceConfig(), kv_bytes_per_token=1000)
    with pytest.raises(DemoConfigError, match="does not split into 64 buffers"):
        demo_geometry(config, OS_PAGE)


class Holder:
    def __init__(self) -> None:
        self.limits: list[int] = []

    def lease_changed(self, limit: int) -> None:
        self.limits.append(limit)


def test_the_counter_counts_lowered_leases_and_passes_every_change_on() -> None:
    counter = ReclaimCounter(StaticLease(100))
    holder = Holder()
    counter.attach(holder)
    assert counter.take_peak() == 100
    for limit in (150, 120, 130, 60):  # what a broker's lease thread would deliver
        counter.lease_changed(limit)
    assert holder.limits == [150, 120, 130, 60]
    assert counter.reclaims == 2 and counter.reclaimed_bytes == 30 + 70
    assert counter.take_peak() == 150  # the highest since the last sample
    assert counter.take_peak() == 60


def test_stamps_live_in_the_pools_memory_and_catch_a_block_overwritten() -> None:
    geometry = KVGeometry(num_buffers=2, block_bytes=OS_PAGE, num_blocks=64, page_size=OS_PAGE)
    pool = KVPool(geometry, open_backend("host"), StaticLease(64 * geometry.page_bytes))
    try:
        blocks = StampedBlocks(pool)
        first = blocks.alloc(2)
        second = blocks.alloc(1)
        assert isinstance(first, list) and isinstance(second, list)
        words = pool.tensor(0)[0].view(dtype=torch.int64)
        assert int(words[first[0], 0]) == int(words[first[1], 0]) != int(words[second[0], 0])
        blocks.free(first)
        words[second[0], 0] = 12345  # as if another owner wrote into the block
        with pytest.raises(AssertionError, match=f"block {second[0]} holds 12345"):
            blocks.free(second)
    finally:
        pool.close()


def test_pages_can_hold_a_set_number_of_blocks_when_the_backend_allows_it() -> None:
    config = TraceConfig(gpu_memory_bytes=4 * GIB)
    assert demo_geometry(config, OS_PAGE, page_blocks=1).page_size == 32 * 2**10
    assert demo_geometry(config, OS_PAGE, page_blocks=64).page_size == 2 * 2**20
    with pytest.raises(DemoConfigError, match="granularity"):
        demo_geometry(config, 64 * 2**10, page_blocks=1)
    with pytest.raises(DemoConfigError, match="positive"):
        demo_geometry(config, OS_PAGE, page_blocks=0)


def test_block_outer_pools_page_one_block_of_every_layer_at_a_time() -> None:
    config = TraceConfig(gpu_memory_bytes=512 * 2**20)
    geometry = demo_geometry(config, OS_PAGE, block_outer=True)
    assert geometry.num_buffers == 1
    assert geometry.block_bytes == config.block_bytes()  # every layer's K and V of a block
    assert geometry.page_size == geometry.block_bytes  # a whole number of granules here
    assert geometry.num_blocks * geometry.block_bytes > config.gpu_memory_bytes
    per_layer = demo_geometry(config, OS_PAGE)  # whole blocks of every layer per page too
    assert per_layer.page_bytes % geometry.page_bytes == 0
