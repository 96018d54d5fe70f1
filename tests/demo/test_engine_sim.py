"""The simulated engine over a real KV pool: admission, preemption, prefix cache, counts.

The pool is the real :class:`KVPool` on the host backend with a static lease, sized in
blocks for each test (one 4 KiB block per page, two buffers).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.demo import trace
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.trace import Request, TraceConfig
from kvshare.runtime.backends import open_backend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

BLOCK_TOKENS = 16
STEP_S = 0.02
PAGE = 4096


def make_pool(blocks: int) -> KVPool:
    """A pool whose lease covers exactly ``blocks`` usable blocks (plus the null block)."""
    geometry = KVGeometry(num_buffers=2, block_bytes=PAGE, num_blocks=blocks + 8, page_size=PAGE)
    return KVPool(
        geometry,
        open_backend("host"),
        StaticLease((blocks + 1) * geometry.page_bytes),
        reserve_pages=0,
        background=False,
    )


@pytest.fixture
def pools() -> Iterator[list[KVPool]]:
    made: list[KVPool] = []
    yield made
    for pool in made:
        pool.close()


def engine(pools: list[KVPool], blocks: int, requests: list[Request]) -> EngineSim:
    pool = make_pool(blocks)
    pools.append(pool)
    sim = EngineSim(requests, pool, block_tokens=BLOCK_TOKENS, step_s=STEP_S)
    pool.set_evictor(sim.prefix_cache)
    return sim


def run_to_end(sim: EngineSim, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if sim.finished():
            return
        sim.step()
    raise AssertionError(f"not finished after {max_steps} steps: {sim.sample()}")


def req(rid: int, prompt: int, output: int, arrival: float = 0.0, prefix: int = 0) -> Request:
    return Request(rid, 0, arrival, prompt, output, prefix)


def test_a_request_without_blocks_waits_and_the_queue_stays_first_in_first_out(
    pools: list[KVPool],
) -> None:
    # 10 blocks. a takes 7 (101 tokens) growing to 8; b needs 7 and must wait for a;
    # c needs 1 and would fit, but waits behind b.
    sim = engine(pools, 10, [req(0, 100, 20), req(1, 100, 5), req(2, 10, 5)])
    sim.step()
    assert sim.sample().running == 1 and sim.sample().waiting == 2
    run_to_end(sim)
    assert sim.stats.wait_arrivals_s == [0.0, 0.0, 0.0]
    a_wait, b_wait, c_wait = sim.stats.waits_s
    assert a_wait == pytest.approx(STEP_S)
    # a runs 19 more steps after its prefill step; b is admitted once a has freed its blocks.
    assert b_wait == pytest.approx(21 * STEP_S)
    assert c_wait >= b_wait
    assert sim.stats.served == 3 and sim.stats.preemptions == 0


def test_a_request_that_cannot_grow_preempts_the_newest_which_is_recomputed(
    pools: list[KVPool],
) -> None:
    # 10 blocks; both start with 4 blocks (61 tokens) and grow to 10 blocks (160 tokens).
    sim = engine(pools, 10, [req(0, 60, 100), req(1, 60, 100)])
    sim.step()
    assert sim.sample().running == 2
    run_to_end(sim)
    assert sim.stats.preemptions >= 1
    assert sim.stats.served == 2
    assert len(sim.stats.waits_s) == 2, "a preempted request keeps its first admission"
    assert pools[0].snapshot().used_blocks == 0


def test_requests_with_the_system_prompt_share_its_full_blocks(pools: list[KVPool]) -> None:
    # Prefix of 64 tokens = 4 full blocks; each prompt of 100 (+1) tokens needs 7 blocks.
    sim = engine(pools, 40, [req(0, 100, 40, prefix=64), req(1, 100, 40, prefix=64)])
    sim.step()
    assert sim.sample().running == 2
    assert sim.used_blocks() == 4 + 3 + 3
    assert pools[0].snapshot().used_blocks == 10


def test_cached_prefix_blocks_outlive_their_requests_and_are_evicted_under_pressure(
    pools: list[KVPool],
) -> None:
    first = [req(0, 100, 10, prefix=64), req(1, 100, 10, prefix=64)]
    # 20 blocks: after the first two finish, 4 stay cached; a request needing 20 blocks
    # (319 + 1 tokens) then only fits by evicting them.
    sim = engine(pools, 20, [*first, req(2, 319, 1, arrival=1.0)])
    for _ in range(20):
        sim.step()
    assert sim.stats.served == 2
    assert sim.prefix_cache.cached_blocks() == 4
    assert pools[0].snapshot().used_blocks == 4
    run_to_end(sim)
    assert sim.prefix_cache.evicted_blocks == 4
    assert sim.stats.served == 3


def test_a_cached_prefix_is_reused_by_the_next_request(pools: list[KVPool]) -> None:
    sim = engine(pools, 40, [req(0, 100, 5, prefix=64), req(1, 100, 5, arrival=1.0, prefix=64)])
    for _ in range(10):
        sim.step()
    allocations = pools[0].snapshot().allocations
    run_to_end(sim)
    assert sim.prefix_cache.evicted_blocks == 0
    # The second request allocated only its own 3 blocks: one call, no prefix blocks.
    assert pools[0].snapshot().used_blocks == 4  # the cached prefix
    assert pools[0].snapshot().allocations == allocations + 1


def test_a_generated_trace_is_served_completely_and_every_block_comes_back(
    pools: list[KVPool],
) -> None:
    config = TraceConfig(seed=5, duration_s=6, models=3, gpu_memory_bytes=2 * 2**30)
    requests = trace.generate(config).for_model(1)
    sim = engine(pools, config.share_blocks(), requests)
    run_to_end(sim, max_steps=200_000)
    assert sim.stats.arrived == sim.stats.served == len(requests)
    waits, arrivals = sim.waits()
    assert len(waits) == len(requests) and sorted(arrivals) == [r.arrival_s for r in requests]
    assert all(w >= 0 for w in waits)
    pool = pools[0]
    assert pool.snapshot().used_blocks == sim.prefix_cache.cached_blocks()
    sim.close()
    assert pool.snapshot().used_blocks == 0


def test_requests_still_queued_at_the_end_count_with_the_time_waited_so_far(
    pools: list[KVPool],
) -> None:
    sim = engine(pools, 10, [req(0, 100, 500), req(1, 100, 5, arrival=0.1)])
    sim.advance(1.0)
    waits, arrivals = sim.waits()
    assert arrivals == [0.0, 0.1]
    assert waits[1] == pytest.approx(0.9)


def test_advance_takes_every_step_due_and_no_more(pools: list[KVPool]) -> None:
    sim = engine(pools, 10, [])
    assert sim.advance(0.1) == 5
    assert sim.advance(0.1) == 0
    assert sim.clock == pytest.approx(0.1)


def test_no_admission_while_the_pool_gives_memory_back_but_running_requests_grow(
    pools: list[KVPool],
) -> None:
    open_ = {"now": True}
    pool = make_pool(40)
    pools.append(pool)
    sim = EngineSim(
        [req(0, 30, 40), req(1, 30, 40, arrival=0.1)],
        pool,
        block_tokens=BLOCK_TOKENS,
        step_s=STEP_S,
        admission_open=lambda: open_["now"],
    )
    sim.step()
    open_["now"] = False
    for _ in range(30):
        sim.step()
    assert sim.sample().running == 1 and sim.sample().waiting == 1
    assert sim.used_blocks() == 4  # 30 + 31 tokens: grown from 2 blocks to 4
    open_["now"] = True
    run_to_end(sim)
    assert sim.stats.served == 2
