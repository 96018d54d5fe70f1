"""Shared compute: an engine alone gets the whole GPU, two busy engines take turns under
time-slicing, and MPS overlaps steps by their demands."""

from __future__ import annotations

import itertools

import pytest

from kvshare.demo.bound import FixedBlocks
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.sim_node import SimClock
from kvshare.demo.step_cost import StepCost, StepWork
from kvshare.demo.trace import Request
from kvshare.twin.arbiter import POLL_S, Slot, roofline_demand, start_engines
from kvshare.twin.gpus import gpu_kind
from kvshare.twin.models import footprint
from kvshare.twin.workload import ModelSpec

STEP = StepCost(0.010, per_token_s=1e-5)


class Timeline:
    """Every step's start and end, per engine (from the slot's hooks)."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.steps: dict[int, list[tuple[float, float]]] = {}

    def slot(self, index: int, engine: EngineSim, demand: float = 1.0) -> Slot:
        starts: list[float] = []

        def began() -> None:
            starts.append(self.clock.now)

        def ended() -> None:
            self.steps.setdefault(index, []).append((starts[-1], self.clock.now))

        return Slot(engine, lambda work, seconds: demand, began, ended)


def _engine(requests: list[tuple[float, int, int]], blocks: int = 10_000) -> EngineSim:
    made = [Request(i, 0, t, p, o, 0) for i, (t, p, o) in enumerate(requests)]
    return EngineSim(made, FixedBlocks(blocks), block_tokens=16, cost=STEP)


def _run(sharing: str, engines: list[EngineSim], demands: list[float] | None = None) -> Timeline:
    clock = SimClock()
    timeline = Timeline(clock)
    slots = [
        timeline.slot(i, e, (demands or [1.0] * len(engines))[i]) for i, e in enumerate(engines)
    ]
    start_engines(clock, sharing, slots)
    clock.run_until(1e6)
    return timeline


def test_an_engine_alone_gets_the_whole_gpu() -> None:
    """Its steps follow each other with no gap, each as long as the cost model says, and
    it keeps the same clock as an engine stepping on a GPU of its own."""
    requests = [(0.0, 300, 50), (0.05, 100, 80), (0.5, 700, 20)]
    timeline = _run("time-slicing", [_engine(requests)])
    own = _engine(requests)
    ends = []
    while not own.finished():
        own.step()
        ends.append(own.clock)
    assert [end for _, end in timeline.steps[0]] == pytest.approx(ends)


def test_two_busy_engines_under_time_slicing_each_get_about_half() -> None:
    work = [(0.0, 200, 400)] * 8
    alone = _run("time-slicing", [_engine(work)]).steps[0]
    both = _run("time-slicing", [_engine(work), _engine(work)])
    span_alone = alone[-1][1] - alone[0][0]
    for index in (0, 1):
        steps = both.steps[index]
        assert len(steps) == len(alone)
        assert (steps[-1][1] - steps[0][0]) / span_alone == pytest.approx(2.0, rel=0.05)
    # One step at a time: no two steps overlap.
    every = sorted(both.steps[0] + both.steps[1])
    assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(every))


def test_ready_steps_take_turns_first_come_first_served() -> None:
    work = [(0.0, 100, 30)]
    both = _run("time-slicing", [_engine(work), _engine(work)])
    order = sorted((start, index) for index in (0, 1) for start, _ in both.steps[index])
    assert [index for _, index in order[:10]] == [0, 1] * 5


def test_mps_steps_that_fit_together_do_not_slow_each_other() -> None:
    work = [(0.0, 100, 40)]
    alone = _run("mps", [_engine(work)]).steps[0]
    both = _run("mps", [_engine(work), _engine(work)], demands=[0.4, 0.5])
    for index in (0, 1):
        assert [e - s for s, e in both.steps[index]] == pytest.approx([e - s for s, e in alone])


def test_mps_steps_that_need_more_than_the_gpu_slow_by_the_sum_of_their_demands() -> None:
    work = [(0.0, 100, 40)]
    alone = _run("mps", [_engine(work)]).steps[0]
    both = _run("mps", [_engine(work), _engine(work)], demands=[0.8, 0.7])
    for index in (0, 1):
        durations = [e - s for s, e in both.steps[index]]
        assert durations == pytest.approx([1.5 * (e - s) for s, e in alone])


def test_mps_never_runs_a_step_faster_than_alone() -> None:
    work = [(0.0, 100, 40), (0.02, 500, 10)]
    alone = _run("mps", [_engine(work)]).steps[0]
    mixed = _run("mps", [_engine(work), _engine([(0.013, 900, 25)])], demands=[0.3, 0.9])
    assert min(e - s for s, e in mixed.steps[0]) >= min(e - s for s, e in alone) - 1e-12


def test_an_engine_that_can_run_nothing_looks_again_without_taking_the_gpu() -> None:
    """Its request does not fit its memory: it polls, and the other engine's steps are
    not delayed."""
    clock = SimClock()
    timeline = Timeline(clock)
    stuck = EngineSim(
        [Request(0, 0, 0.0, 5000, 10, 0)],
        FixedBlocks(10),
        block_tokens=16,
        cost=STEP,
        patience_s=1.0,
    )
    busy = _engine([(0.0, 100, 60)])
    start_engines(clock, "time-slicing", [timeline.slot(0, stuck), timeline.slot(1, busy)])
    clock.run_until(10.0)
    assert all(start == end for start, end in timeline.steps[0])  # it never held the GPU
    ends = [end for _, end in timeline.steps[1]]
    alone = _run("time-slicing", [_engine([(0.0, 100, 60)])]).steps[0]
    assert ends == pytest.approx([end for _, end in alone])
    assert stuck.stats.abandoned == 1 and stuck.steps >= 1.0 / POLL_S * 0.9


def test_the_roofline_demand_of_a_decode_step_is_bandwidth_and_of_a_prefill_compute() -> None:
    gpu = gpu_kind("h200_sxm")
    item = footprint(ModelSpec("m", "meta-llama/Llama-3.1-8B"), gpu)
    demand = roofline_demand(item, gpu)
    decode = StepWork(0, 0, 32, 32 * 1000)
    # 16 GB of weights at 4.8 TB/s is 3.3 ms of a step of about 5 ms.
    assert 0.5 < demand(decode, 0.005) < 0.9
    prefill = StepWork(8192, 8192 * 8192, 0, 0)
    # 2 x 8e9 x 8192 FLOPs at 989 TFLOP/s is 133 ms.
    assert demand(prefill, 0.2) == pytest.approx(0.133 * 1.06 / 0.2, rel=0.1)
    assert demand(prefill, 0.05) == 1.0  # never more than the whole GPU
