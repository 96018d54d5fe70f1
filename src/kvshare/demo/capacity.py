"""The demo's headline: capacity at the latency SLO in each world, from the GPU twin.

The live part of the demo runs real processes on a fake GPU; how much traffic a real GPU
serves within a latency SLO is the twin's question (``kvshare.twin``, docs/twin.md). The
demo asks it of one workload of the twin's suite (a traffic family, its first seed,
shortened to :data:`DEFAULT_DURATION_S` so that it answers in well under a minute), in
four worlds: static partitions, first-come sharing (kvcached alone), kvshare under the
broker's default policy, and the pooled bound. It reports each world's capacity (the
largest load scale at which the SLO holds, ``kvshare.twin.compare``) and draws the
capacity curves: the least model's attainment (its share of requests within both
latency targets) against the load scale, one line per world, every request counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY
from kvshare.twin import families
from kvshare.twin.compare import compare_worlds
from kvshare.twin.workload import MAX_SCALE
from kvshare.twin.worlds import TwinOptions, run_world, world_names

__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_DURATION_S",
    "DEFAULT_FAMILY",
    "CapacityReport",
    "capacity_at_slo",
    "capacity_lines",
]

#: The suite's workload the demo measures: an on/off fleet of six 8B-class models (most
#: idle most of the time, the busy ones swinging within a minute) on one H200.
DEFAULT_FAMILY = "fleet-onoff"
DEFAULT_CLASS = "8b"
GPU = "h200_sxm"
#: Simulated seconds of the workload (the suite runs 240): enough for every model's busy
#: and idle periods, short enough for the demo's two minutes.
DEFAULT_DURATION_S = 120.0
#: The capacity search's precision (relative), and the load scales of the curves as
#: shares of the pooled bound's capacity.
PRECISION = 0.03
CURVE_POINTS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25)


@dataclass(frozen=True)
class CapacityReport:
    """Each world's capacity at the SLO on one workload, and its attainment curve."""

    workload: str
    requests: int
    gpu: str
    slo: str
    #: World name -> the largest load scale found to meet the SLO.
    capacity: dict[str, float]
    #: World name -> (load scale, the least model's attainment), by scale.
    curves: dict[str, list[tuple[float, float]]]

    def ratio(self, world: str, baseline: str) -> float:
        """``world``'s capacity over ``baseline``'s (0 when the baseline serves none)."""
        base = self.capacity[baseline]
        return self.capacity[world] / base if base else 0.0


def capacity_at_slo(
    family: str = DEFAULT_FAMILY,
    model_class: str = DEFAULT_CLASS,
    *,
    duration_s: float = DEFAULT_DURATION_S,
    curve_points: Sequence[float] = CURVE_POINTS,
) -> CapacityReport:
    """Measure the workload ``family`` (seed 0, ``model_class`` models, ``duration_s``
    simulated seconds) in the twin: each world's capacity, then its attainment at
    ``curve_points`` times the pooled bound's capacity."""
    # A pool missing a reclaim deadline past capacity is expected; the report says what
    # matters.
    logging.getLogger("kvshare").setLevel(logging.ERROR)
    workload = families.generate(
        family, seed=0, gpu=GPU, model_class=model_class, duration_s=duration_s
    )
    worlds = world_names((DEFAULT_POLICY,))
    found = compare_worlds(workload, worlds, TwinOptions(), precision=PRECISION)
    bound = found.scale("pooled-bound")
    scales = sorted({min(MAX_SCALE, round(bound * p, 4)) for p in curve_points if bound * p > 0})
    every_request = TwinOptions(judge_early=False)
    curves = {
        world: [
            (s, min(run_world(world, workload.at_scale(s), every_request).verdict.attainment))
            for s in scales
        ]
        for world in worlds
    }
    slo = workload.slo
    return CapacityReport(
        workload=workload.name,
        requests=len(workload.requests),
        gpu=GPU,
        slo=(
            f"p99 TTFT <= {slo.ttft_p99_s:g} s, p99 TPOT <= {slo.tpot_p99_ms:g} ms, every "
            f"model >= {slo.min_attainment:.0%} within both"
        ),
        capacity={w: found.scale(w) for w in worlds},
        curves=curves,
    )


def capacity_lines(report: CapacityReport) -> list[str]:
    """The headline: capacity at the SLO per world, and kvshare against each baseline."""
    kv = f"kvshare:{DEFAULT_POLICY}"
    lines = [
        f"Capacity at the latency SLO ({report.slo}), GPU twin of one {report.gpu}, "
        f"workload {report.workload} ({report.requests} requests at load scale 1):",
    ]
    for world, scale in report.capacity.items():
        lines.append(f"  {world:<22} {scale:6.2f}x load")
    lines.append(
        f"kvshare serves x{report.ratio(kv, 'static'):.2f} the load of static partitions at "
        f"the SLO, x{report.ratio(kv, 'first-come'):.2f} that of first-come sharing, "
        f"x{report.ratio(kv, 'pooled-bound'):.2f} of the pooled bound."
    )
    return lines
