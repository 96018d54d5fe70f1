"""Static-vs-elastic accounting: percentiles, memory over time, totals, and the books."""

from __future__ import annotations

import json

import pytest

from kvshare.demo import stats
from kvshare.demo.stats import Sample, ServerResult

MIB = 2**20


def sample(
    t: float, held: int, *, lease: int | None = None, peak: int | None = None, served: int = 0
) -> Sample:
    lease = held if lease is None else lease
    return Sample(
        t=t,
        served=served,
        arrived=served,
        waiting=0,
        running=0,
        held=held,
        used=held // 2,
        lease=lease,
        lease_peak=lease if peak is None else peak,
        preemptions=0,
        reclaims=0,
    )


def result(mode: stats.Mode, model: int, samples: list[Sample], **counts: object) -> ServerResult:
    values: dict[str, object] = {
        "offered": 10,
        "arrived": 4,
        "served": 3,
        "preemptions": 1,
        "reclaims": 0,
        "reclaimed_bytes": 0,
        "waits_s": [0.0, 1.0, 2.0, 10.0],
        "wait_arrivals_s": [0.0, 0.5, 1.0, 1.5],
    }
    values.update(counts)
    return ServerResult(mode=mode, model=model, samples=samples, **values)  # type: ignore[arg-type]


def test_percentile_is_nearest_rank_and_zero_without_values() -> None:
    assert stats.percentile([], 95) == 0.0
    assert stats.percentile([3.0, 1.0, 2.0], 50) == 2.0
    values = [float(v) for v in range(1, 101)]
    assert stats.percentile(values, 95) == 95.0
    assert stats.percentile(values, 100) == 100.0


def test_a_model_summary_has_delays_and_peak_and_mean_memory() -> None:
    summary = stats.summarize(
        result("elastic", 1, [sample(0, 100 * MIB), sample(1, 300 * MIB), sample(2, 200 * MIB)])
    )
    assert summary.served == 3 and summary.offered == 10 and summary.arrived == 4
    assert summary.p50_wait_s == 1.0
    assert summary.p95_wait_s == 10.0
    assert summary.peak_kv == 300 * MIB
    assert summary.mean_kv == pytest.approx(200 * MIB)
    assert summary.mean_used == pytest.approx(100 * MIB)


def test_totals_add_servers_at_the_same_moments() -> None:
    # Server b samples later than a: at each of a's times, b counts with its latest sample.
    a = result("elastic", 0, [sample(0.0, 100), sample(1.0, 100), sample(2.0, 100)])
    b = result("elastic", 1, [sample(0.5, 50), sample(1.5, 500)])
    assert stats.total_kv_series([a, b]) == [(0.0, 100), (1.0, 150), (2.0, 600)]
    total = stats.summarize_all("elastic", [a, b])
    assert total.peak_kv == 600
    # A better source of the total (the broker's books) replaces the sum of samples.
    booked = stats.summarize_all("elastic", [a, b], [(0.0, 100), (1.0, 400)])
    assert booked.peak_kv == 400 and booked.mean_kv == 250
    assert total.served == 6 and total.offered == 20 and total.preemptions == 2
    # Delays are pooled over every request of every model.
    assert total.p95_wait_s == 10.0 and total.p50_wait_s == 1.0


def test_the_comparison_ratio_is_elastic_over_static_served() -> None:
    runs = [
        result("static", 0, [sample(0, 10)], served=4),
        result("static", 1, [sample(0, 10)], served=6),
        result("elastic", 0, [sample(0, 10)], served=9),
        result("elastic", 1, [sample(0, 10)], served=6),
    ]
    comparison = stats.compare(runs)
    assert comparison.static.served == 10 and comparison.elastic.served == 15
    assert comparison.ratio == pytest.approx(1.5)
    assert [(s.mode, s.model) for s in comparison.per_model] == [
        ("static", 0),
        ("static", 1),
        ("elastic", 0),
        ("elastic", 1),
    ]


def test_a_pool_growing_beyond_its_lease_is_an_over_commitment() -> None:
    shrinking = result(
        "elastic",
        1,
        [sample(0, 100, lease=100), sample(1, 100, lease=60, peak=100), sample(2, 80, lease=60)],
    )
    # Grew to 150 under a lease of 160 that was lowered to 120 before the sample.
    grew_then_reclaimed = result(
        "elastic", 3, [sample(0, 100, lease=100), sample(1, 150, lease=120, peak=160)]
    )
    grown = result("elastic", 2, [sample(0, 100, lease=100), sample(1, 101, lease=100)])
    (violation,) = stats.check_pool_books([shrinking, grew_then_reclaimed, grown])
    assert violation.t == 1
    assert "elastic model 2 grew to 101 bytes, over its lease (at most 100" in violation.what


def test_counts_that_disagree_with_the_trace_are_reported() -> None:
    assert stats.check_consistency(result("static", 0, [])) == []
    served_too_many = result("static", 0, [], served=5)
    assert "served 5 <= arrived 4" in stats.check_consistency(served_too_many)[0]
    missing_delay = result("static", 0, [], waits_s=[1.0], wait_arrivals_s=[0.0])
    assert "1 queueing delays for 4 arrived" in stats.check_consistency(missing_delay)[0]


def test_samples_and_results_cross_the_pipe_as_json_lines() -> None:
    original = sample(1.25, 64 * MIB, served=7)
    message = json.loads(original.to_json())
    assert message["kind"] == "sample"
    assert stats.sample_from_message(message) == original
    sent = result("elastic", 0, [original])
    payload = json.loads(sent.to_json())
    assert payload["kind"] == "result" and "samples" not in payload
    assert ServerResult.from_message(payload, [original]) == sent
