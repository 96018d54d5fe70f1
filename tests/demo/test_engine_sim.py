"""The simulated engine over a real KV pool: admission, preemption, prefix cache, counts.

The pool is the real :class:`KVPool` on the host backend with a static lease, sized in
blocks for each test (one 4 KiB block per page, two buffers).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.demo import trace
from kvshare.demo.engine_sim import EngineSim, StepCost
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
    sim = EngineSim(requests, pool, block_tokens=BLOCK_TOKENS, cost=StepCost(STEP_S))
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


def test_after_each_step_the_pool_hears_how_many_blocks_the_next_one_takes(
    pools: list[KVPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool shrinking to a lowered lease keeps empty pages for the blocks its running
    requests take in the next step, and no more: a decoding request takes one only when
    its next token starts a block."""
    # Both have their first token in step 1, in 2 blocks of 16 tokens: a's prompt and
    # first token fill them (its next token starts a third), b's leave room for 11 more.
    sim = engine(pools, 16, [req(0, 31, 3), req(1, 20, 3)])
    told: list[int] = []
    monkeypatch.setattr(pools[-1], "expect_blocks", told.append)
    run_to_end(sim)
    assert told == [1, 0, 0] and sim.steps == 3


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
    sim.advance(0.5)
    assert sim.stats.served == 2
    assert sim.prefix_cache.cached_blocks() == 4
    assert pools[0].snapshot().used_blocks == 4
    run_to_end(sim)
    assert sim.prefix_cache.evicted_blocks == 4
    assert sim.stats.served == 3


def test_a_cached_prefix_is_reused_by_the_next_request(pools: list[KVPool]) -> None:
    sim = engine(pools, 40, [req(0, 100, 5, prefix=64), req(1, 100, 5, arrival=1.0, prefix=64)])
    sim.advance(0.5)
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
    sim = engine(pools, 10, [req(0, 10, 100)])
    assert sim.advance(0.1) == 5
    assert sim.advance(0.1) == 0
    assert sim.clock == pytest.approx(0.1)


def test_an_idle_engine_waits_for_the_next_arrival_instead_of_stepping(
    pools: list[KVPool],
) -> None:
    sim = engine(pools, 10, [req(0, 10, 2, arrival=0.5)])
    assert sim.advance(0.4) == 0 and sim.clock == pytest.approx(0.4)
    assert sim.next_step_at() == pytest.approx(0.5)
    sim.advance(1.0)
    assert sim.stats.served == 1
    assert sim.stats.waits_s == [pytest.approx(STEP_S)]  # scheduled as it arrived
    assert sim.steps == 2


def test_a_client_out_of_patience_before_its_first_token_abandons_the_request(
    pools: list[KVPool],
) -> None:
    # 10 blocks: a holds 7 to 10 of them for 50 steps (1 s); b needs 7 and cannot start
    # before a is done, but its client waits only 0.5 s.
    pool = make_pool(10)
    pools.append(pool)
    requests = [req(0, 100, 50), req(1, 100, 5, arrival=0.1), req(2, 10, 5, arrival=3.0)]
    sim = EngineSim(
        requests, pool, block_tokens=BLOCK_TOKENS, cost=StepCost(STEP_S), patience_s=0.5
    )
    sim.advance(0.6)
    assert sim.stats.abandoned == 0 and sim.sample().waiting == 1
    sim.advance(0.7)  # b has waited more than 0.5 s: its client left
    assert sim.stats.abandoned == 1 and sim.sample().waiting == 0
    run_to_end(sim)
    assert sim.finished()
    assert sim.stats.served == 2 and sim.stats.arrived == 3
    waits, arrivals = sim.waits()
    assert dict(zip(arrivals, waits, strict=True))[0.1] == pytest.approx(0.5)
    assert len(waits) == 3  # every arrived request has a delay, abandoned ones included


def test_a_preempted_request_already_had_its_first_token_and_is_never_abandoned(
    pools: list[KVPool],
) -> None:
    # Both start with 4 blocks and grow to 10: one is preempted and waits about 2 s for
    # the other to finish, longer than the patience, yet its client stays.
    pool = make_pool(10)
    pools.append(pool)
    requests = [req(0, 60, 100), req(1, 60, 100)]
    sim = EngineSim(
        requests, pool, block_tokens=BLOCK_TOKENS, cost=StepCost(STEP_S), patience_s=0.5
    )
    run_to_end(sim)
    assert sim.stats.preemptions >= 1
    assert sim.stats.served == 2 and sim.stats.abandoned == 0


def test_patience_must_be_positive(pools: list[KVPool]) -> None:
    pool = make_pool(4)
    pools.append(pool)
    with pytest.raises(ValueError, match="patience_s must be > 0"):
        EngineSim([], pool, block_tokens=BLOCK_TOKENS, cost=StepCost(STEP_S), patience_s=0)


def test_a_step_costs_what_its_batch_computes_and_attends_to(pools: list[KVPool]) -> None:
    cost = StepCost(STEP_S, per_token_s=0.001, per_context_token_s=0.0001)
    pool = make_pool(40)
    pools.append(pool)
    # Two 32-token prompts admitted together, then two requests decoding.
    sim = EngineSim([req(0, 32, 3), req(1, 32, 3)], pool, block_tokens=BLOCK_TOKENS, cost=cost)
    sim.step()
    assert sim.clock == pytest.approx(STEP_S + 64 * 0.001)  # both prefills, no context yet
    first = sim.clock
    sim.step()
    # Two decoded tokens over 2 x 33 tokens of context.
    assert sim.clock - first == pytest.approx(STEP_S + 2 * 0.001 + 66 * 0.0001)
    assert sim.stats.waits_s == [pytest.approx(first)] * 2  # first tokens at the step's end


def test_the_step_token_cap_defers_admissions_to_the_next_step(pools: list[KVPool]) -> None:
    cost = StepCost(STEP_S, per_token_s=0.001, max_tokens=100)
    pool = make_pool(40)
    pools.append(pool)
    requests = [req(0, 60, 50), req(1, 60, 50), req(2, 200, 5)]
    sim = EngineSim(requests, pool, block_tokens=BLOCK_TOKENS, cost=cost)
    sim.step()
    assert sim.sample().running == 1  # 60 + 60 would exceed 100 tokens
    sim.step()
    assert sim.sample().running == 2  # 1 decoded + 60 fit
    sim.step()
    # The 200-token prompt exceeds what the 2 decodes leave of the cap, but a step's first
    # admission always goes (chunked prefill would start it).
    assert sim.sample().running == 3


def test_a_cached_prefix_is_not_computed_again(pools: list[KVPool]) -> None:
    cost = StepCost(STEP_S, per_token_s=0.001)
    pool = make_pool(40)
    pools.append(pool)
    requests = [req(0, 100, 2, prefix=64), req(1, 100, 2, arrival=1.0, prefix=64)]
    sim = EngineSim(requests, pool, block_tokens=BLOCK_TOKENS, cost=cost)
    sim.step()
    assert sim.tokens == 100
    sim.advance(2.0)
    assert sim.stats.served == 2
    assert sim.tokens == 100 + 1 + (100 - 64) + 1  # the second computed only 36 prompt tokens


def test_a_client_whose_patience_runs_out_during_its_prefill_step_has_left(
    pools: list[KVPool],
) -> None:
    # The first prompt's step takes 0.12 s; the second's (the cap puts it into the next
    # step, beside one decoded token) 0.421 s more: its first token would come at 0.541 s.
    cost = StepCost(STEP_S, per_token_s=0.001, max_tokens=150)
    pool = make_pool(40)
    pools.append(pool)
    requests = [req(0, 100, 2), req(1, 400, 2, arrival=0.0)]
    sim = EngineSim(requests, pool, block_tokens=BLOCK_TOKENS, cost=cost, patience_s=0.5)
    sim.advance(2.0)
    assert sim.stats.abandoned == 1 and sim.stats.served == 1
    assert sorted(sim.stats.waits_s) == [pytest.approx(0.12), 0.5]
    assert pool.snapshot().used_blocks == 0, "the dropped request's blocks came back"


def test_a_preempted_request_recomputes_what_it_had_and_goes_on_from_there(
    pools: list[KVPool],
) -> None:
    # 10 blocks; both start with 4 blocks (61 tokens) and grow until the newer is preempted
    # (about 20 tokens out); the other finishes at step 100. Readmitted, the preempted one
    # prefills its prompt and its tokens so far in one step and decodes only the rest: done
    # at step 180, where starting again from its first token would take it to 200.
    sim = engine(pools, 10, [req(0, 60, 100), req(1, 60, 100)])
    run_to_end(sim)
    assert sim.stats.preemptions == 1 and sim.stats.served == 2
    assert sim.clock < 190 * STEP_S
