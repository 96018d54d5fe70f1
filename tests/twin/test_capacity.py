"""The capacity search: the known threshold of a synthetic predicate, found to its precision."""

from __future__ import annotations

import math

import pytest

from kvshare.twin.capacity import capacity, fleet_gpus, models_per_gpu


@pytest.mark.parametrize("threshold", [0.05, 0.4, 1.0, 2.7, 9.9, 31.0])
def test_it_finds_the_threshold_of_a_predicate_within_its_precision(threshold: float) -> None:
    found = capacity(lambda s: s <= threshold, precision=0.03)
    assert found.scale <= threshold < found.missed_at
    assert found.missed_at / found.scale <= 1.03 + 1e-9
    # Every scale it tried got the predicate's own answer.
    assert all(met == (s <= threshold) for s, met in found.tried)


def test_a_larger_threshold_never_gives_a_smaller_capacity() -> None:
    thresholds = [0.3 * 1.17**k for k in range(25)]
    found = [capacity(lambda s, t=t: s <= t).scale for t in thresholds]
    assert found == sorted(found)


def test_nothing_met_is_zero_and_everything_met_is_the_largest_scale() -> None:
    assert capacity(lambda s: False).scale == 0.0
    everything = capacity(lambda s: True, max_scale=64.0)
    assert everything.scale == 64.0 and everything.missed_at == math.inf


def test_the_search_takes_few_runs() -> None:
    calls: list[float] = []

    def meets(scale: float) -> bool:
        calls.append(scale)
        return scale <= 5.3

    capacity(meets, start=4.0)
    assert len(calls) <= 8


def test_models_per_gpu_is_the_most_that_meet_and_the_fleet_follows() -> None:
    assert models_per_gpu(lambda n: n <= 11) == 11
    assert models_per_gpu(lambda n: n <= 1) == 1
    assert models_per_gpu(lambda n: False) == 0
    assert models_per_gpu(lambda n: True, most=40) == 40
    for start in (1, 4, 11, 12, 30):
        assert models_per_gpu(lambda n: n <= 11, start=start) == 11
    assert fleet_gpus(11) == 5 and fleet_gpus(48) == 1 and fleet_gpus(0) == math.inf


@pytest.mark.parametrize(
    ("threshold", "probes"),
    [
        (2.0, (3.0, 2.05, 1.8)),
        (2.0, (2.5, 3.0)),
        (2.0, (1.0, 1.5)),
        (0.1, (1.0, 4.0)),
        (50.0, (1, 2)),
    ],
)
def test_probes_narrow_the_search_and_never_change_the_answer(
    threshold: float, probes: tuple[float, ...]
) -> None:
    plain = capacity(lambda s: s <= threshold)
    probed = capacity(lambda s: s <= threshold, probes=probes)
    assert probed.scale <= threshold < probed.missed_at
    assert probed.missed_at / probed.scale <= 1.03 + 1e-9
    if min(probes) <= threshold < max(probes):
        assert len(probed.tried) < len(plain.tried)
