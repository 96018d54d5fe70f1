"""The elastic win's targets, one set for every benchmark that measures it.

``elastic`` (the default trace), ``elastic-suite`` (the trace suite with real processes)
and ``elastic-sim`` (the suite in simulated time) judge the same claim: on every trace,
an elastic GPU captures at least ``GAIN_SHARE`` of the gain that one shared block pool
allows, leaves no model below ``WORST_MODEL`` of ``min(static, shared bound)`` for it,
and serves at least ``DEFAULT_RATIO`` times the static partitions on the default trace.
"""

from __future__ import annotations

from harness import Target

GAIN_SHARE = 0.8
WORST_MODEL = 0.9
DEFAULT_RATIO = 1.5


def suite_targets(label: str) -> list[Target]:
    """The per-trace targets on the suite's summary fields of the run named ``label``."""
    return [
        Target(f"gain_min.{label}", ">=", GAIN_SHARE),
        Target(f"worst_min.{label}", ">=", WORST_MODEL),
    ]


def default_ratio_target(field: str) -> Target:
    """The default trace's ratio of served requests, elastic over static, in ``field``."""
    return Target(field, ">=", DEFAULT_RATIO)
