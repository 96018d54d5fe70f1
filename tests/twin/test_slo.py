"""The SLO predicate: nearest-rank percentiles as counts of misses, given-up requests
as misses, every model's attainment, and a run judged as soon as it certainly misses."""

from __future__ import annotations

import math

from kvshare.demo.sim_node import SimClock
from kvshare.demo.trace import Request
from kvshare.twin.slo import RequestRecord, SloMonitor, allowed_misses, judge
from kvshare.twin.workload import Slo
from kvshare.twin.worlds import TwinOptions, run_world
from tests.twin.helpers import onoff

SLO = Slo(ttft_p99_s=2.0, tpot_p99_ms=100.0, min_attainment=0.95)


def _records(
    count: int, model: int = 0, ttft: float = 0.1, tpot: float = 0.02
) -> list[RequestRecord]:
    return [RequestRecord(model, ttft, tpot) for _ in range(count)]


def test_allowed_misses_are_what_the_nearest_rank_percentile_leaves() -> None:
    assert allowed_misses(100, 0.99) == 1
    assert allowed_misses(99, 0.99) == 0
    assert allowed_misses(1000, 0.99) == 10
    assert allowed_misses(20, 0.95) == 1


def test_a_run_within_both_targets_meets_the_slo() -> None:
    verdict = judge(SLO, _records(200), [200])
    assert verdict.met and verdict.gave_up == 0 and verdict.attainment == (1.0,)


def test_given_up_requests_count_as_misses() -> None:
    records = _records(98) + [RequestRecord(0, None, None)] * 2
    verdict = judge(SLO, records, [100])
    assert not verdict.met
    assert verdict.gave_up == 2 and verdict.ttft_p99_s == math.inf
    # The same two requests served late but within the targets would have met it.
    served = _records(98) + _records(2, ttft=1.9)
    assert judge(SLO, served, [100]).met


def test_one_model_below_its_attainment_misses_the_slo_though_the_percentiles_hold() -> None:
    # 1000 requests: 10 slow ones keep p99 within target, but they are all model 1's,
    # 10 of its 100.
    records = _records(900, model=0) + _records(90, model=1) + _records(10, model=1, ttft=3.0)
    verdict = judge(SLO, records, [900, 100])
    assert verdict.ttft_p99_s <= 2.0
    assert not verdict.met and verdict.attainment == (1.0, 0.9)


def test_slow_tokens_miss_like_a_slow_first_token() -> None:
    records = _records(95) + _records(5, tpot=0.2)
    verdict = judge(SLO, records, [100])
    assert not verdict.met and verdict.tpot_p99_s == 0.2


def test_an_overloaded_run_is_stopped_once_it_certainly_misses() -> None:
    heavy = onoff(models=2, duration_s=60.0, busy_rps=60.0, prompt=(2000, 4000), seed=3)
    done = run_world("static", heavy, TwinOptions())
    assert not done.verdict.met and done.verdict.stopped_early
    assert done.sim_s < 60.0


def test_a_run_told_not_to_judge_early_counts_every_request() -> None:
    heavy = onoff(models=2, duration_s=60.0, busy_rps=60.0, prompt=(2000, 4000), seed=3)
    done = run_world("static", heavy, TwinOptions(judge_early=False))
    assert not done.verdict.met and not done.verdict.stopped_early
    # Every request judged: the attainment is the share of all of each model's requests.
    assert done.verdict.requests == len(heavy.requests)
    assert done.sim_s > 60.0


class _Waiting:
    """An engine seen only through what the monitor asks it: how many of its requests
    arrived before a time and have not been admitted."""

    def __init__(self, arrivals: list[float]) -> None:
        self.arrivals = arrivals

    def overdue(self, cutoff_s: float) -> int:
        return sum(1 for t in self.arrivals if t < cutoff_s)


def test_a_request_waiting_past_the_ttft_target_is_not_yet_a_tpot_miss() -> None:
    # 200 requests allow 2 misses of each percentile and 10 of the model's attainment.
    # Two served with slow tokens, one waiting 3 s for its first token: the TTFT part
    # can still hold (one miss at most) and so can the TPOT part (the waiting request's
    # tokens may come fast), so the run goes on.
    monitor = SloMonitor(SLO, [0] * 200, 1)
    clock = SimClock()
    monitor.watch(clock, [_Waiting([0.0])])  # type: ignore[list-item]
    for rid in (1, 2):
        request = Request(rid, 0, 0.0, 100, 11, 0)
        monitor.first_token(request, 0.1)
        monitor.finished(request, 0.1, 2.1)  # 200 ms per output token
    clock.run_until(3.0)
    assert not monitor.failed and not clock.stopped
    # A third slow-token request does settle it.
    request = Request(3, 0, 0.0, 100, 11, 0)
    monitor.first_token(request, 0.1)
    monitor.finished(request, 0.1, 2.1)
    assert monitor.failed and clock.stopped
