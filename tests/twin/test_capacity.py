"""The capacity search: the known threshold of a synthetic predicate, found to its precision."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kvshare.twin.capacity import (
    Capacity,
    capacity,
    fleet_gpus,
    models_per_gpu,
    on_common_ladder,
)


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


def test_a_capacity_on_an_island_of_met_verdicts_drops_to_the_load_held_below_it() -> None:
    """World a's search landed on 1.091, which it meets, but it misses at 1.076, where
    world b was tried: on the common ladder a holds 1.062, the load it held below."""
    truth = {
        "a": lambda s: s <= 1.07 or 1.085 <= s <= 1.095,  # an island at 1.085-1.095
        "b": lambda s: s <= 1.07,
    }
    ran: list[tuple[str, float]] = []

    def meets(world: str) -> Callable[[float], bool]:
        def judge(scale: float) -> bool:
            ran.append((world, scale))
            return truth[world](scale)

        return judge

    found = {
        "a": Capacity(1.091, 1.102, ((1.0, True), (1.091, True), (1.102, False))),
        "b": Capacity(1.062, 1.076, ((1.035, True), (1.062, True), (1.076, False))),
        "lent": Capacity(1.05, 1.2, ((1.05, True), (1.2, False))),
    }
    settled = on_common_ladder(found, meets, judged=["a", "b"])
    assert (settled["a"].scale, settled["a"].missed_at) == (1.062, 1.076)
    assert (settled["b"].scale, settled["b"].missed_at) == (1.062, 1.076)
    # a was judged at b's scales within 10 % below its capacity (and at the lent world's),
    # b at a's and the lent one's below its own; a lent world is never run again.
    assert sorted(ran) == [
        ("a", 1.035),
        ("a", 1.05),
        ("a", 1.062),
        ("a", 1.076),
        ("b", 1.0),
        ("b", 1.05),
    ]
    assert settled["lent"] is found["lent"]
