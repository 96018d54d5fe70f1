"""The engine as the twin runs it: chunked prefill within vLLM's token budget, each
request's first and last token told as they happen, and requests already overdue."""

from __future__ import annotations

import pytest

from kvshare.demo.bound import FixedBlocks
from kvshare.demo.engine_api import EngineRequest
from kvshare.demo.engine_sim import EngineSim, SchedulerLimits
from kvshare.demo.step_cost import StepCost, StepWork
from kvshare.demo.trace import Request


class Seen:
    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.done: dict[int, tuple[float, float]] = {}
        self.given_up: dict[int, float] = {}

    def first_token(self, request: EngineRequest, at_s: float) -> None:
        self.first[request.rid] = at_s

    def finished(self, request: EngineRequest, first_token_s: float, last_token_s: float) -> None:
        self.done[request.rid] = (first_token_s, last_token_s)

    def gave_up(self, request: EngineRequest, at_s: float) -> None:
        self.given_up[request.rid] = at_s


class Recorded:
    """A cost model that keeps every step's work."""

    def __init__(self) -> None:
        self.works: list[StepWork] = []

    def step_seconds(self, work: StepWork) -> float:
        self.works.append(work)
        return 0.01


def _engine(
    requests: list[Request], budget: int, cost: object, seen: Seen, blocks: int = 10_000
) -> EngineSim:
    return EngineSim(
        requests,
        FixedBlocks(blocks),
        block_tokens=16,
        cost=cost,  # type: ignore[arg-type]
        limits=SchedulerLimits(max_tokens=budget, max_running=8, chunked_prefill=True),
        observer=seen,
        patience_s=60.0,
    )


def test_a_long_prompt_is_computed_in_chunks_within_the_budget() -> None:
    seen, cost = Seen(), Recorded()
    engine = _engine([Request(0, 0, 0.0, 2500, 3, 0)], 1000, cost, seen)
    while not engine.finished():
        engine.step()
    prefills = [w.prefill_tokens for w in cost.works]
    assert prefills[:3] == [1000, 1000, 500]
    assert all(w.tokens <= 1000 for w in cost.works)
    # Each chunk's attention is priced against the whole prompt's length.
    assert cost.works[0].prefill_attended == 1000 * 2500
    # The first token comes with the step that computes the last chunk.
    assert seen.first[0] == pytest.approx(0.03)
    assert seen.done[0] == (pytest.approx(0.03), pytest.approx(0.05))


def test_running_requests_decode_before_a_chunk_takes_the_rest_of_the_budget() -> None:
    seen, cost = Seen(), Recorded()
    requests = [Request(0, 0, 0.0, 100, 50, 0), Request(1, 0, 0.015, 3000, 2, 0)]
    engine = _engine(requests, 1000, cost, seen)
    while not engine.finished():
        engine.step()
    mixed = [w for w in cost.works if w.prefill_tokens and w.decode_requests]
    assert mixed and all(w.decode_requests == 1 and w.tokens <= 1000 for w in mixed)
    assert [w.prefill_tokens for w in mixed] == [999, 999, 999, 3]


def test_without_chunked_prefill_the_first_admission_goes_in_whole() -> None:
    cost = Recorded()
    engine = EngineSim(
        [Request(0, 0, 0.0, 2500, 3, 0)],
        FixedBlocks(10_000),
        block_tokens=16,
        cost=cost,  # type: ignore[arg-type]
        limits=SchedulerLimits(max_tokens=1000),
    )
    engine.step()
    assert cost.works[0].prefill_tokens == 2500


def test_time_per_output_token_is_what_the_steps_took() -> None:
    seen = Seen()
    engine = _engine([Request(0, 0, 0.0, 10, 11, 0)], 1000, StepCost(0.02), seen)
    while not engine.finished():
        engine.step()
    first, last = seen.done[0]
    assert (last - first) / 10 == pytest.approx(0.02)


def test_requests_already_overdue_are_counted_queued_or_not_yet_taken_in() -> None:
    seen = Seen()
    requests = [Request(i, 0, 0.1 * i, 5000, 5, 0) for i in range(10)]
    engine = _engine(requests, 8192, StepCost(0.01), seen, blocks=400)  # one fits at a time
    engine.begin_step(0.35)
    engine.end_step(0.36)
    # Requests 0-3 arrived by 0.35: 0 was admitted, 1-3 queue; 4-9 have not been taken in.
    assert engine.overdue(0.25) == 2  # 1 and 2 arrived before 0.25
    assert engine.overdue(0.95) == 9  # 1-3 queued, 4-9 not taken in yet


def test_a_client_that_gives_up_is_told() -> None:
    seen = Seen()
    engine = EngineSim(
        [Request(0, 0, 0.0, 5000, 5, 0)],
        FixedBlocks(10),
        block_tokens=16,
        cost=StepCost(0.01),
        patience_s=1.0,
        observer=seen,
    )
    while not engine.finished():
        engine.step()
    assert seen.given_up == {0: pytest.approx(1.0, abs=0.02)} and not seen.first
