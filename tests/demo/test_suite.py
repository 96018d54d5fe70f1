"""The trace suite: every family makes valid traces, the same for the same seed, with
the traffic its documentation promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.demo import suite, trace


@pytest.fixture(scope="module")
def traces() -> dict[str, trace.Trace]:
    return {t.name: t.trace for t in suite.suite()}


def test_every_trace_of_the_suite_saves_loads_and_replays_the_same(
    traces: dict[str, trace.Trace], tmp_path: Path
) -> None:
    assert len(traces) >= 10
    for name, made in traces.items():
        path = tmp_path / f"{name}.json"
        trace.save(made, path)
        assert trace.load(path) == made, name
        family, seed = name.rsplit("-", 1)
        assert suite.make(family, int(seed)) == made, "a seed always gives the same trace"
        assert made.source or family == "default"


def test_one_model_dominates_with_40_to_60_percent_of_the_requests(
    traces: dict[str, trace.Trace],
) -> None:
    for seed in (0, 1):
        made = traces[f"dominant-{seed}"]
        share = len(made.for_model(0)) / len(made.requests)
        assert 0.35 <= share <= 0.65, share


def test_many_models_are_busy_at_overlapping_but_not_identical_times(
    traces: dict[str, trace.Trace],
) -> None:
    for seed, models in ((0, 8), (1, 10), (2, 12)):
        made = traces[f"many-{seed}"]
        assert made.config.models == models
        assert made.config.share_blocks() == suite.SETUP.share_blocks()
        windows = trace.busy_windows(made)
        busy_models = {w.model for w in windows}
        assert len(busy_models) >= models // 2
        overlaps = sum(
            1
            for a in windows
            for b in windows
            if a.model < b.model and a.start_s < b.end_s and b.start_s < a.end_s
        )
        assert overlaps > 0


def test_a_diurnal_day_rises_and_falls(traces: dict[str, trace.Trace]) -> None:
    made = traces["diurnal-0"]
    third = made.config.duration_s / 3
    counts = [
        sum(1 for r in made.requests if k * third <= r.arrival_s < (k + 1) * third)
        for k in range(3)
    ]
    assert counts[1] > 1.5 * counts[0] and counts[1] > 1.5 * counts[2]


def test_long_context_prompts_are_long_and_heavy_tailed(traces: dict[str, trace.Trace]) -> None:
    made = traces["long-context-0"]
    prompts = sorted(r.prompt_tokens for r in made.requests)
    assert prompts[len(prompts) // 2] > 1500
    assert prompts[-1] > 4 * prompts[len(prompts) // 2] or prompts[-1] > 8000


def test_an_unknown_family_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: default, dominant"):
        suite.make("bursty", 0)
