"""The twin's workload: validation where it is built, and load scaling that only adds."""

from __future__ import annotations

import itertools

import pytest

from kvshare.twin.workload import (
    COPY_JITTER_S,
    ModelSpec,
    Slo,
    TwinRequest,
    Workload,
    WorkloadError,
)


def _workload(count: int = 400) -> Workload:
    models = (ModelSpec("a", "meta-llama/Llama-3.1-8B"), ModelSpec("b", "Qwen/Qwen3-8B"))
    requests = tuple(TwinRequest(i * 0.25, "ab"[i % 2], 100 + i, 20 + i % 7) for i in range(count))
    return Workload("two", "h200_sxm", models, requests, duration_s=count * 0.25, seed=3)


def _keys(workload: Workload) -> set[tuple[float, str, int]]:
    return {(r.arrival_s, r.model, r.prompt_tokens) for r in workload.requests}


def test_scaled_load_only_grows_with_the_scale() -> None:
    base = _workload()
    scales = [0.3, 0.7, 1.0, 1.5, 2.0, 3.25]
    sets = [_keys(base.at_scale(s)) for s in scales]
    for smaller, larger in itertools.pairwise(sets):
        assert smaller <= larger
    assert _keys(base.at_scale(1.0)) == _keys(base)


def test_scaled_load_is_about_the_scale_and_keeps_the_time_shape() -> None:
    base = _workload(2000)
    scaled = base.at_scale(2.5)
    assert 2.3 * 2000 < len(scaled.requests) < 2.7 * 2000
    arrivals = [r.arrival_s for r in scaled.requests]
    assert arrivals == sorted(arrivals)
    assert max(arrivals) <= max(r.arrival_s for r in base.requests) + COPY_JITTER_S
    # Copies keep their original's lengths and model.
    assert {(r.model, r.prompt_tokens, r.output_tokens) for r in scaled.requests} == {
        (r.model, r.prompt_tokens, r.output_tokens) for r in base.requests
    }


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1000.0])
def test_a_scale_that_cannot_be_run_is_refused(scale: float) -> None:
    with pytest.raises(WorkloadError, match="load scale"):
        _workload().at_scale(scale)


def test_a_request_for_an_unknown_model_is_refused_with_the_known_ones() -> None:
    models = (ModelSpec("a", "meta-llama/Llama-3.1-8B"),)
    with pytest.raises(WorkloadError, match=r"'zz'.*\['a'\]"):
        Workload("w", "h200_sxm", models, (TwinRequest(0.0, "zz", 10, 10),), 10.0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelSpec("a", "llama-8b"), "Hugging Face-style"),
        (lambda: ModelSpec("a", "x/y", engine="trt"), "engine"),
        (lambda: TwinRequest(-1.0, "a", 10, 10), "arrival"),
        (lambda: TwinRequest(0.0, "a", 0, 10), "must be >= 1"),
        (lambda: TwinRequest(0.0, "a", 10, 10, prefix_tokens=11), "prefix_tokens"),
        (lambda: Slo(ttft_p99_s=0), "ttft_p99_s"),
        (lambda: Slo(min_attainment=1.5), "min_attainment"),
    ],
)
def test_values_no_twin_could_run_are_refused_where_they_enter(build, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WorkloadError, match=message):
        build()
