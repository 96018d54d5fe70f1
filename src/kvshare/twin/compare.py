"""Every world's capacity on one workload, and the models per GPU of a traffic family: what
the ``capacity`` benchmark and ``python -m kvshare.twin`` report.

The pooled bound is searched first (its runs are the cheapest: no pages, no broker), then
static partitions; the other worlds are probed at the bound's edge and a little below
it first (their capacity usually lies just under the bound), then at static's capacity
and at the edges already found for the other sharing worlds (so first-come and kvshare
are both tried at the same scales);
:func:`~kvshare.twin.capacity.capacity` checks every probe, so a wrong guess costs runs,
not the answer. Last, every world is judged on the common ladder of scales
(:func:`~kvshare.twin.capacity.on_common_ladder`): its capacity is a load at which it
met the SLO and met it at every load tried below, by any world.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshare.twin.capacity import (
    DEFAULT_PRECISION,
    Capacity,
    capacity,
    models_per_gpu,
    on_common_ladder,
)
from kvshare.twin.workload import Workload
from kvshare.twin.worlds import TwinOptions, run_world

__all__ = ["Comparison", "compare_worlds", "gain_share", "models_per_gpu_by_world"]

BOUND = "pooled-bound"
STATIC = "static"


@dataclass(frozen=True)
class Comparison:
    """Each world's capacity on one workload (by world name)."""

    workload: str
    requests: int
    capacities: dict[str, Capacity]

    def scale(self, world: str) -> float:
        """The world's capacity (a load scale)."""
        return self.capacities[world].scale

    def ratio(self, world: str, baseline: str) -> float:
        """``world``'s capacity over ``baseline``'s (inf when the baseline serves none)."""
        base = self.scale(baseline)
        return self.scale(world) / base if base else math.inf

    def gain_share(self, world: str) -> float | None:
        """(world - static) / (bound - static); None where the bound gains nothing."""
        return gain_share(self.scale(world), self.scale(STATIC), self.scale(BOUND))


def gain_share(world: float, static: float, bound: float) -> float | None:
    """The share of what pooling gains over static partitions that ``world`` captured
    (None when the bound does not exceed static)."""
    if bound <= static:
        return None
    return (world - static) / (bound - static)


def compare_worlds(
    workload: Workload,
    worlds: Sequence[str],
    options: TwinOptions,
    *,
    precision: float = DEFAULT_PRECISION,
    reference: Comparison | None = None,
) -> Comparison:
    """The capacity of every world of ``worlds`` on ``workload`` (see the module doc);
    ``reference``, the same workload's comparison under other options, lends its bound
    and static capacities for the probes."""
    found: dict[str, Capacity] = {}
    if reference is not None:
        found.update({w: reference.capacities[w] for w in (BOUND, STATIC)})

    def meets(world: str) -> Callable[[float], bool]:
        return lambda scale: run_world(world, workload.at_scale(scale), options).verdict.met

    order = [w for w in (BOUND, STATIC) if w in worlds] + [
        w for w in worlds if w not in (BOUND, STATIC)
    ]
    for world in order:
        probes: list[float] = []
        if BOUND in found and STATIC in found and world not in (BOUND, STATIC):
            bound, static = found[BOUND], found[STATIC]
            # Most worlds land just under the bound: first its edge, then a little and
            # more below it, then static's capacity.
            probes = [bound.missed_at, bound.scale, bound.scale * 0.9, bound.scale * 0.75]
            probes = [p for p in probes if 0 < p < math.inf] + [static.scale]
            # The edges already found for the other sharing worlds: a world compared with
            # them is then tried at their capacity itself, so the ratio of the two rests on
            # runs at the same scale, not on two searches' independent roundings.
            for other, edge in found.items():
                if other not in (BOUND, STATIC):
                    probes += [edge.scale, edge.missed_at]
            probes = [p for p in probes if 0 < p < math.inf]
        found[world] = capacity(meets(world), precision=precision, probes=probes)
    lent = set() if reference is None else {BOUND, STATIC}
    judged = [w for w in order if w not in lent]
    found = on_common_ladder(found, meets, judged=judged)
    return Comparison(workload.name, len(workload.requests), {w: found[w] for w in worlds})


def models_per_gpu_by_world(
    make: Callable[[int], Workload],
    worlds: Sequence[str],
    options: TwinOptions,
    *,
    most: int,
    start: int = 1,
) -> dict[str, int]:
    """Per world, the most models ``n`` for which the workload ``make(n)`` meets its SLO
    (up to ``most``, searched from ``start``)."""

    def meets(world: str) -> Callable[[int], bool]:
        return lambda n: run_world(world, make(n), options).verdict.met

    return {world: models_per_gpu(meets(world), most=most, start=start) for world in worlds}
