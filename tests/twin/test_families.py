"""Workload families: valid and reproducible for every class and seed, with the shape each
one documents measurable in what it generates."""

from __future__ import annotations

import math
import statistics
from itertools import pairwise
from pathlib import Path

import pytest

from kvshare.twin import families
from kvshare.twin.workload import Workload, WorkloadError
from kvshare.twin.workload_files import load_workload

SEEDS = (0, 1, 2)


def _times(workload: Workload, model: str) -> list[float]:
    return [request.arrival_s for request in workload.for_model(model)]


def _cv(times: list[float]) -> float:
    gaps = [later - earlier for earlier, later in pairwise(times)]
    return statistics.pstdev(gaps) / statistics.mean(gaps)


@pytest.mark.parametrize("model_class", families.MODEL_CLASSES)
@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_family_generates_a_valid_reproducible_workload(
    family: str, model_class: str
) -> None:
    for seed in SEEDS:
        workload = families.generate(family, seed=seed, model_class=model_class)
        assert workload == families.generate(family, seed=seed, model_class=model_class)
        assert len(workload.models) == families.DEFAULT_MODELS[family][model_class]
        assert {m.architecture for m in workload.models} == set(
            families.CLASS_ARCHITECTURES[model_class]
        )
        assert workload.duration_s == families.DEFAULT_DURATION_S
        # Low thousands of requests at scale 1, every model with some.
        assert 1_000 <= len(workload.requests) <= 6_000
        assert all(workload.for_model(model.name) for model in workload.models)
        assert all(0 <= r.arrival_s < workload.duration_s for r in workload.requests)
        # The mean rate is the stated base load (within what chance allows).
        rate = len(workload.requests) / workload.duration_s
        base = families.BASE_LOAD_SHARE * families.ROUGH_CAPACITY_RPS[model_class]
        assert 0.6 * base < rate < 1.5 * base
    other = families.generate(family, seed=99, model_class=model_class)
    assert other.requests != workload.requests


@pytest.mark.parametrize("family", families.FAMILIES)
def test_n_models_and_duration_are_honoured(family: str) -> None:
    workload = families.generate(family, seed=4, model_class="small", n_models=3, duration_s=90)
    assert [m.name for m in workload.models] == ["qwen3-0.6b-00", "qwen3-1.7b-01", "qwen3-0.6b-02"]
    assert workload.duration_s == 90
    assert all(r.arrival_s < 90 for r in workload.requests)


def test_fleet_onoff_models_idle_over_ten_seconds_and_swing_over_5x_within_a_minute() -> None:
    for seed in SEEDS:
        workload = families.generate("fleet-onoff", seed=seed, model_class="small")
        idle = swinging = 0
        for model in workload.models:
            times = [0.0, *_times(workload, model.name), workload.duration_s]
            idle += any(later - earlier > 10 for earlier, later in pairwise(times))
            counts = [0] * math.ceil(workload.duration_s / 10)
            for t in times[1:-1]:
                counts[int(t // 10)] += 1
            # Requests per 10 s, within any minute: highest over lowest busy window.
            swings = [
                max(window) / min(window)
                for start in range(len(counts) - 5)
                if len(window := [c for c in counts[start : start + 6] if c]) >= 2
            ]
            swinging += bool(swings) and max(swings) > 5
        # Prism/Hyperbolic: over 60 % of models have many idle periods over 10 s.
        assert idle >= 0.6 * len(workload.models)
        assert swinging >= 0.6 * len(workload.models)


def test_fleet_onoff_popularity_has_a_long_tail() -> None:
    workload = families.generate("fleet-onoff", seed=0, model_class="small")
    counts = sorted((len(workload.for_model(m.name)) for m in workload.models), reverse=True)
    assert counts[0] > 4 * counts[-1]


def test_gamma_bursts_are_burstier_than_poisson_and_api_more_than_conversation() -> None:
    conversation, api = [], []
    for seed in SEEDS:
        workload = families.generate("gamma-bursts", seed=seed, model_class="small")
        for index, model in enumerate(workload.models):
            (conversation if index % 2 == 0 else api).append(_cv(_times(workload, model.name)))
    # Gaps' coefficient of variation 1/sqrt(shape): 1.41 and 2 (Poisson: 1).
    assert all(cv > 1.1 for cv in conversation + api)
    assert 1.2 < statistics.mean(conversation) < 1.65
    assert 1.7 < statistics.mean(api) < 2.3


def test_zipf_small_rank_frequency_slope_is_about_minus_one() -> None:
    slopes = []
    for seed in SEEDS:
        workload = families.generate("zipf-small", seed=seed, model_class="small")
        counts = [len(workload.for_model(m.name)) for m in workload.models]
        xs = [math.log(rank) for rank in range(1, len(counts) + 1)]
        ys = [math.log(count) for count in counts]
        slopes.append(statistics.linear_regression(xs, ys).slope)
    assert all(-1.25 < slope < -0.75 for slope in slopes)
    assert -1.1 < statistics.mean(slopes) < -0.9


def test_long_context_puts_prompts_of_thousands_of_tokens_on_one_model() -> None:
    workload = families.generate("long-context", seed=0)
    long_model, *chat_models = workload.models
    long_prompts = [r.prompt_tokens for r in workload.for_model(long_model.name)]
    assert min(long_prompts) >= 2048
    assert statistics.median(long_prompts) > 2500
    assert all(r.prompt_tokens + r.output_tokens <= 16384 for r in workload.requests)
    for model in chat_models:
        assert all(r.prompt_tokens <= 1024 for r in workload.for_model(model.name))


def _hourly(workload: Workload, models: list[str]) -> list[int]:
    counts = [0] * 24
    for request in workload.requests:
        if request.model in models:
            counts[int(24 * request.arrival_s / workload.duration_s)] += 1
    return counts


def test_diurnal_code_swings_about_tenfold_and_conversation_about_twofold() -> None:
    workload = families.generate("diurnal", seed=0, model_class="small", duration_s=960)
    names = [m.name for m in workload.models]
    code, conversation = _hourly(workload, names[:4]), _hourly(workload, names[4:])

    def swing(counts: list[int]) -> float:
        # Three-hour windows around the busiest and the quietest part of the day.
        windows = [sum(counts[(h + i) % 24] for i in range(3)) for h in range(24)]
        return max(windows) / min(windows)

    assert swing(code) > 5
    assert 1.5 < swing(conversation) < 3.5
    # Code peaks in the evening (UTC), conversation in the afternoon.
    assert 17 <= max(range(24), key=code.__getitem__) <= 22
    assert 11 <= max(range(24), key=conversation.__getitem__) <= 18
    # Lengths follow the Azure 2023 traces: code prompts long with short outputs.
    code_requests = [r for r in workload.requests if r.model in names[:4]]
    assert 1000 < statistics.median(r.prompt_tokens for r in code_requests) < 2000
    assert statistics.median(r.output_tokens for r in code_requests) < 25


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"family": "poisson"}, "not one of"),
        ({"model_class": "70b"}, "model class"),
        ({"gpu": "tpu_v5"}, "gpu"),
        ({"n_models": 0}, "n_models"),
        ({"n_models": 1000}, "n_models"),
        ({"duration_s": float("nan")}, "duration_s"),
        ({"duration_s": -5.0}, "duration_s"),
    ],
)
def test_arguments_that_cannot_be_generated_are_refused(arguments: dict, problem: str) -> None:
    family = arguments.pop("family", "diurnal")
    with pytest.raises(WorkloadError, match=problem):
        families.generate(family, seed=0, **arguments)


def test_the_command_writes_files_that_load_back_as_the_generated_workload(tmp_path: Path) -> None:
    arguments = [
        "--family",
        "zipf-small",
        "--seed",
        "3",
        "--model-class",
        "small",
        "--n-models",
        "5",
    ]
    assert families.main([*arguments, "--out", str(tmp_path)]) == 0
    (yaml_path,) = tmp_path.glob("*.yaml")
    expected = families.generate("zipf-small", seed=3, model_class="small", n_models=5)
    assert load_workload(yaml_path) == expected


def test_the_command_refuses_a_bad_count_without_writing(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        families.main(
            ["--family", "diurnal", "--seed", "1", "--n-models", "0", "--out", str(tmp_path)]
        )
    assert list(tmp_path.iterdir()) == []
