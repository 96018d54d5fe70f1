"""Where the memory is while a model is starved: the diagnosis over real pools and engines."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.demo import trace
from kvshare.demo.elastic_sim import simulate
from kvshare.demo.engine_sim import EngineSim, StepCost
from kvshare.demo.sim_diagnosis import Diagnosis
from kvshare.demo.trace import Request, TraceConfig
from kvshare.runtime.backends import open_backend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

BLOCK = 4096
PER_PAGE = 4  # blocks per page of every buffer
GEOMETRY = KVGeometry(num_buffers=2, block_bytes=BLOCK, num_blocks=64, page_size=PER_PAGE * BLOCK)


@pytest.fixture
def pools() -> Iterator[list[KVPool]]:
    made = [
        KVPool(
            GEOMETRY,
            open_backend("host"),
            StaticLease(pages * GEOMETRY.page_bytes),
            reserve_pages=0,
            background=False,
        )
        for pages in (2, 4)
    ]
    yield made
    for pool in made:
        pool.close()


def engine(pool: KVPool, requests: list[Request]) -> EngineSim:
    return EngineSim(requests, pool, block_tokens=16, cost=StepCost(fixed_s=0.02))


def test_a_starved_model_counts_what_the_others_lease_unused_and_what_of_it_is_stranded(
    pools: list[KVPool],
) -> None:
    starved_pool, other_pool = pools
    # The starved model's only request needs 16 blocks; its lease holds 7 (8, less the
    # null block).
    starved = engine(starved_pool, [Request(0, 0, 0.0, 16 * 16 - 1, 4, 0)])
    starved.step()
    assert starved.blocks_to_admit_next() == 16
    # The other model runs nothing; a block is held on its second page (outside its
    # engine: the first page holds the null block and three more), so the three free
    # blocks beside it cannot go back with the page.
    other = engine(other_pool, [])
    assert other_pool.alloc(PER_PAGE)
    diagnosis = Diagnosis(gpu_blocks=32)
    diagnosis([starved_pool, other_pool], [starved, other])
    assert diagnosis.samples == diagnosis.starved_samples == 1
    assert diagnosis.idle_starved == 7 / 32  # its free blocks, which the head does not fit
    assert diagnosis.idle_elsewhere == 15 / 32  # its engine uses nothing of 16 less the null
    assert diagnosis.stranded == (PER_PAGE - 1) / 32  # beside the block on the second page


def test_nothing_is_counted_while_no_model_is_starved(pools: list[KVPool]) -> None:
    quiet = [engine(pool, []) for pool in pools]
    diagnosis = Diagnosis(gpu_blocks=32)
    diagnosis(pools, quiet)
    assert diagnosis.samples == 1 and diagnosis.starved_samples == 0
    assert diagnosis.summary() == {
        "starved_share": 0.0,
        "idle_elsewhere": 0.0,
        "stranded": 0.0,
        "idle_starved": 0.0,
    }


def test_a_simulated_run_is_sampled_on_its_clock_and_its_shares_are_shares() -> None:
    config = TraceConfig(duration_s=24, models=3, gpu_memory_bytes=3 * 2**30, seed=2)
    made = trace.generate(config)
    diagnosis = Diagnosis(config.gpu_memory_bytes // config.block_bytes(), interval_s=0.5)
    simulate(made, watch=diagnosis)
    assert diagnosis.samples == pytest.approx(24 / 0.5, abs=1)
    assert 0 < diagnosis.starved_share <= 1
    assert 0 <= diagnosis.stranded <= diagnosis.idle_elsewhere <= 1
