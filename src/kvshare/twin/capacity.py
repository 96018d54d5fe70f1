"""Capacity at the SLO: the most load, and the most models, one GPU serves while every
request is held to the workload's latency SLO.

- :func:`capacity`: the largest load scale (:meth:`~kvshare.twin.workload.Workload.at_scale`)
  at which a world meets the SLO. The search brackets the threshold by doubling or
  halving from a first guess, then bisects until the bracket is narrower than
  ``precision`` (relative: the answer is within ``precision`` of the threshold, below it).
  It trusts that more load never helps (``at_scale`` only adds requests); where a run's
  verdict is not monotone in the scale it finds one threshold, not necessarily the
  largest.
- :func:`on_common_ladder`: worlds compared on one workload, each judged also at the
  scales the others were tried at just below its capacity, and held to the largest scale
  it met below the smallest it missed. Near the edge a run's verdict is not always
  monotone (p99 TPOT near its target moves with which prefills share a step, so a world
  may miss at one scale and meet 1 % above it); a search that happened to land on such
  an island would report a load the world does not hold below it, and two worlds'
  searches land on different islands. A capacity is a load at which the SLO holds and
  held at every load tried below it, by any world.
- :func:`models_per_gpu`: the most models of a traffic family's shape one GPU serves at
  the SLO (the family generated for ``n`` models at its own load), and :func:`fleet_gpus`
  the GPUs a fleet of such models needs in each world.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kvshare.twin.workload import MAX_SCALE, Workload

__all__ = [
    "DEFAULT_PRECISION",
    "FLEET_MODELS",
    "Capacity",
    "capacity",
    "fleet_gpus",
    "models_per_gpu",
    "on_common_ladder",
]

#: Relative width of the bracket the bisection stops at.
DEFAULT_PRECISION = 0.03
#: The smallest scale searched: below it a world is said to serve nothing at the SLO.
MIN_SCALE = 1 / 64
#: Models in the fleet whose GPU count is reported.
FLEET_MODELS = 48
#: How far below its capacity (relative) a world is also judged at the others' scales.
LADDER_WINDOW = 0.1


@dataclass(frozen=True)
class Capacity:
    """The largest scale found to meet the SLO (0: not even :data:`MIN_SCALE`), the
    smallest found to miss it (``math.inf``: none up to the largest scale allowed), and
    every scale tried with its verdict."""

    scale: float
    missed_at: float
    tried: tuple[tuple[float, bool], ...] = field(default=())


def capacity(
    meets: Callable[[float], bool],
    *,
    start: float = 1.0,
    precision: float = DEFAULT_PRECISION,
    max_scale: float = MAX_SCALE,
    probes: Sequence[float] = (),
) -> Capacity:
    """The largest scale at which ``meets(scale)`` holds (see the module doc).

    ``probes`` are scales where the threshold likely lies (another world's answers): they
    are tried from the largest down until one holds, which brackets the threshold with the
    last that did not; the search doubles up from the largest if it holds, and halves
    down from the smallest if none does. Without probes it starts at ``start``."""
    if not precision > 0 or not 0 < start <= max_scale:
        raise ValueError("need precision > 0 and 0 < start <= max_scale")
    tried: dict[float, bool] = {}

    def check(scale: float) -> bool:
        if scale not in tried:
            tried[scale] = meets(scale)
        return tried[scale]

    low, high = 0.0, math.inf
    ladder = sorted({min(max(p, MIN_SCALE), max_scale) for p in probes}, reverse=True)
    for scale in ladder or [start]:
        if check(scale):
            low = scale
            break
        high = scale
    while high == math.inf and low < max_scale:
        scale = min(low * 2, max_scale)
        if check(scale):
            low = scale
        else:
            high = scale
    while low == 0.0 and high > MIN_SCALE:
        scale = max(high / 2, MIN_SCALE)
        if check(scale):
            low = scale
        else:
            high = scale
    if low == 0.0 or high == math.inf:
        return Capacity(low, high, tuple(sorted(tried.items())))
    return _bisect(check, low, high, precision, tried)


def _bisect(
    check: Callable[[float], bool],
    low: float,
    high: float,
    precision: float,
    tried: dict[float, bool],
) -> Capacity:
    """Narrow ``[low, high)`` (``low`` met, ``high`` missed) to ``precision``."""
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        if check(middle):
            low = middle
        else:
            high = middle
    return Capacity(low, high, tuple(sorted(tried.items())))


def on_common_ladder(
    found: Mapping[str, Capacity],
    meets: Callable[[str], Callable[[float], bool]],
    *,
    judged: Collection[str],
    window: float = LADDER_WINDOW,
) -> dict[str, Capacity]:
    """Each world of ``judged`` also tried at every scale any world of ``found`` was tried
    at within ``window`` below its capacity, until none is left untried; its capacity is
    then the largest scale it met below the smallest it missed (see the module doc).
    ``meets(world)`` judges ``world`` at a scale; the worlds not in ``judged`` (lent by
    another comparison) only lend their scales."""
    tried = {world: dict(found[world].tried) for world in found}
    untried = True
    while untried:
        untried = False
        ladder = sorted({scale for scales in tried.values() for scale in scales})
        for world in judged:
            edge = _monotone(tried[world]).scale
            for scale in ladder:
                if edge / (1 + window) <= scale < edge and scale not in tried[world]:
                    tried[world][scale] = meets(world)(scale)
                    untried = True
    return {**found, **{world: _monotone(tried[world]) for world in judged}}


def _monotone(tried: Mapping[float, bool]) -> Capacity:
    """The largest scale met below the smallest missed, from every verdict in ``tried``."""
    missed = min((scale for scale, met in tried.items() if not met), default=math.inf)
    scale = max((s for s, met in tried.items() if met and s < missed), default=0.0)
    return Capacity(scale, missed, tuple(sorted(tried.items())))


def workload_capacity(
    workload: Workload,
    meets: Callable[[Workload], bool],
    *,
    start: float = 1.0,
    precision: float = DEFAULT_PRECISION,
) -> Capacity:
    """:func:`capacity` of ``workload`` under the predicate ``meets`` on a scaled copy."""
    return capacity(lambda s: meets(workload.at_scale(s)), start=start, precision=precision)


def models_per_gpu(meets: Callable[[int], bool], *, most: int = 64, start: int = 1) -> int:
    """The most models ``n`` (up to ``most``) for which ``meets(n)`` holds: from
    ``start`` (a count likely to meet, such as a family's own) up by doubling while it
    holds, then bisecting; below ``start`` by bisecting when it does not (0 when not even
    one model meets it)."""
    start = min(max(start, 1), most)
    if meets(start):
        low, high = start, None
        while high is None:
            step = min(low * 2, most)
            if step == low:
                return low
            if meets(step):
                low = step
            else:
                high = step
    else:
        low, high = 0, start
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return low


def fleet_gpus(models_per_gpu: int, fleet: int = FLEET_MODELS) -> float:
    """GPUs a fleet of ``fleet`` models needs at ``models_per_gpu`` per GPU
    (``math.inf`` when a GPU serves none)."""
    return math.ceil(fleet / models_per_gpu) if models_per_gpu else math.inf
