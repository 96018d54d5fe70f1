"""Arrival processes the workload families are built from.

Each function returns sorted arrival times in ``[start, end)`` seconds, drawn from the
``random.Random`` it is given (so a family's seed fixes every arrival).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["OnOff", "gamma_renewal", "on_off", "poisson", "thinned"]


def poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    """A Poisson process of ``rate`` requests per second."""
    times: list[float] = []
    if rate <= 0:
        return times
    now = start + rng.expovariate(rate)
    while now < end:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def thinned(
    rng: random.Random, rate: Callable[[float], float], peak: float, start: float, end: float
) -> list[float]:
    """A Poisson process whose rate changes with time, ``rate(t) <= peak`` everywhere.

    Lewis and Shedler's thinning: candidates arrive at ``peak`` and each is kept with
    probability ``rate(t) / peak``.
    """
    return [t for t in poisson(rng, peak, start, end) if rng.random() * peak < rate(t)]


def gamma_renewal(
    rng: random.Random, rate: float, shape: float, start: float, end: float
) -> list[float]:
    """Arrivals whose gaps are independent Gamma(``shape``, scale ``1 / (rate * shape)``).

    The mean rate is ``rate``; the gaps' coefficient of variation is ``1 / sqrt(shape)``
    (above 1, burstier than Poisson, for ``shape < 1``). The process starts 20 mean gaps
    before ``start`` and what arrives before ``start`` is dropped, so ``start`` falls at a
    random point of the process rather than just after an arrival.
    """
    if rate <= 0:
        return []
    scale = 1.0 / (rate * shape)
    now = start - 20.0 / rate
    times: list[float] = []
    while True:
        now += rng.gammavariate(shape, scale)
        if now >= end:
            return times
        if now >= start:
            times.append(now)


@dataclass(frozen=True)
class OnOff:
    """A model that alternates idle and busy periods, its busy rate swinging.

    Idle periods last ``min_off_s`` plus an exponential time of mean ``mean_extra_off_s``;
    busy periods an exponential time of mean ``mean_on_s``. While busy, the rate is the
    busy rate times a level drawn log-uniformly from ``[1, level_ratio]``, drawn again every
    ``level_period_s``.
    """

    mean_on_s: float
    min_off_s: float
    mean_extra_off_s: float
    level_ratio: float
    level_period_s: float

    @property
    def busy_fraction(self) -> float:
        """The long-run share of time spent busy."""
        return self.mean_on_s / (self.mean_on_s + self.min_off_s + self.mean_extra_off_s)

    @property
    def mean_level(self) -> float:
        """The mean of the log-uniform level."""
        return (self.level_ratio - 1.0) / math.log(self.level_ratio)

    def mean_rate(self, busy_rate: float) -> float:
        """The long-run request rate of a model with ``busy_rate``."""
        return busy_rate * self.busy_fraction * self.mean_level


def on_off(
    rng: random.Random, busy_rate: float, spec: OnOff, start: float, end: float
) -> list[float]:
    """Arrivals of one model following ``spec`` (it starts busy with the long-run odds)."""
    times: list[float] = []
    now = start
    busy = rng.random() < spec.busy_fraction
    while now < end:
        if not busy:
            now += spec.min_off_s + rng.expovariate(1.0 / spec.mean_extra_off_s)
        else:
            stop = min(end, now + rng.expovariate(1.0 / spec.mean_on_s))
            while now < stop:
                level = math.exp(rng.uniform(0.0, math.log(spec.level_ratio)))
                until = min(stop, now + spec.level_period_s)
                times.extend(poisson(rng, busy_rate * level, now, until))
                now = until
        busy = not busy
    return times
