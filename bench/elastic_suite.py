"""Benchmark ``elastic-suite``: kvshare against static partitions on traffic it was not tuned on.

Every trace of the suite (``kvshare.demo.suite``: the default, one dominant model, many
Markov-modulated models, a diurnal day, long contexts; several seeds each) runs as the
demo runs it — real node agents, real model-server processes with real pools, the trace
four times as fast as the wall clock — in three worlds at once: static partitions, and one
elastic world per broker policy (today's ``fair-share`` and ``entitlement``), each with its
own node agent. Every elastic pool has ``kvCache.min`` 0, as in the demo; the first seed
of the default, dominant and many families runs again with ``kvCache.min`` at a quarter
of an equal share (fields ``...@min``; the others would not fit in the 10 minutes).

Per trace and policy: ``static``, ``elastic``, ``shared`` (requests served; ``shared`` is
the demo's simulation of one block pool that any model takes from at once), the ``gain``
share ``(elastic - static) / (shared - static)``, ``worst``: the least any model served
against ``min(its static count, its count in the shared bound)``, and ``p99`` time to first
token per world (clients that gave up count with their patience). For the suite:
``gain_min``, ``gain_median`` and ``worst_min`` per policy. A trace on which sharing could
gain almost nothing (shared within 3 % of static) has no meaningful gain share: it counts
as met when elastic serves at least 97 % of static (field ``flat`` lists them).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from elastic_targets import suite_targets
from harness import Result
from kvshare.demo import suite, trace
from kvshare.demo.orchestrator import DemoOptions, DemoOutcome, run_demo
from kvshare.demo.stats import Comparison, percentile

POLICIES = ("fair-share", "entitlement")
#: The policy the fairness target holds to.
CANDIDATE = "entitlement"
#: A trace whose shared bound is within this of static has no gain to share.
FLAT = 0.03
#: kvCache.min, as a fraction of an equal share, of the second pass, and its families.
KV_MIN_SHARE = 0.25
MIN_FAMILIES = ("default", "dominant", "many")


@dataclass(frozen=True)
class _Measured:
    gain: float
    worst: float
    ratio: float


def _gain(static: int, elastic: int, shared: int) -> float:
    if shared - static <= FLAT * static:
        return 1.0 if elastic >= (1 - FLAT) * static else elastic / static - 1
    return (elastic - static) / (shared - static)


def _worst(comparison: Comparison, partitioned: tuple[int, ...], shared: tuple[int, ...]) -> float:
    served = {s.model: s.served for s in comparison.per_model if s.mode == "elastic"}
    ratios = [
        served[model] / floor
        for model, floor in enumerate(map(min, partitioned, shared))
        if floor > 0
    ]
    return min(ratios, default=1.0)


def _p99(outcome: DemoOutcome, world: str) -> float:
    waits = [w for r in outcome.results_of(world) for w in r.waits_s]
    return percentile(waits, 99)


def run_trace(
    name: str,
    made: trace.Trace,
    folder: Path,
    kv_min_share: float,
    fields: dict[str, float | int | str],
    *,
    policies: tuple[str, ...] = POLICIES,
    block_outer: bool = False,
) -> dict[str, _Measured]:
    """Run ``made`` in a static world and one elastic world per policy at once (real
    processes); its figures go into ``fields`` under ``name``, and each policy's result
    is returned."""
    path = folder / f"{name}.json"
    trace.save(made, path)
    outcome = run_demo(
        DemoOptions(
            trace_file=path,
            output=folder / name,
            metrics_port=0,
            live=False,
            plot=False,
            policies=policies,
            kv_min_share=kv_min_share,
            block_outer=block_outer,
        ),
        sys.stderr,
    )
    if not outcome.ok:
        raise RuntimeError(f"{name}: {outcome.problems or 'over-committed memory'}")
    bound = outcome.bound
    assert bound is not None, "run_demo always simulates what the trace allows"
    static, shared = sum(bound.partitioned), sum(bound.shared)
    tag = name if not kv_min_share else f"{name}@min"
    fields[f"{tag}.static"] = static
    fields[f"{tag}.shared"] = shared
    fields[f"{tag}.p99.static"] = round(_p99(outcome, "static"), 2)
    measured = {}
    for world, comparison in outcome.comparisons.items():
        policy = outcome.policies[world] or "default"
        elastic = comparison.elastic.served
        gain = _gain(comparison.static.served, elastic, shared)
        worst = _worst(comparison, bound.partitioned, bound.shared)
        measured[policy] = _Measured(gain, worst, comparison.ratio)
        fields[f"{tag}.elastic.{policy}"] = elastic
        fields[f"{tag}.gain.{policy}"] = round(gain, 3)
        fields[f"{tag}.worst.{policy}"] = round(worst, 3)
        fields[f"{tag}.p99.{policy}"] = round(_p99(outcome, world), 2)
    fields[f"{tag}.static_served_real"] = outcome.comparison.static.served
    return measured


def first_of_each_family() -> list[suite.SuiteTrace]:
    """The suite's first trace of every family."""
    firsts: dict[str, suite.SuiteTrace] = {}
    for made in suite.suite():
        firsts.setdefault(made.family, made)
    return list(firsts.values())


def run(quick: bool) -> Result:
    traces = first_of_each_family() if quick else suite.suite()
    fields: dict[str, float | int | str] = {}
    per_policy: dict[str, list[_Measured]] = {p: [] for p in POLICIES}
    flat: list[str] = []
    second_pass: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-suite-") as out:
        folder = Path(out)
        for made in traces:
            for policy, m in run_trace(made.name, made.trace, folder, 0.0, fields).items():
                per_policy[policy].append(m)
            if fields[f"{made.name}.shared"] - fields[f"{made.name}.static"] <= FLAT * float(
                fields[f"{made.name}.static"]
            ):
                flat.append(made.name)
        for made in traces:
            if made.family in second_pass or made.family not in MIN_FAMILIES:
                continue
            second_pass.add(made.family)
            for policy, m in run_trace(made.name, made.trace, folder, KV_MIN_SHARE, fields).items():
                per_policy[policy].append(m)
    summary: dict[str, float | int | str] = {}
    for policy, measured in per_policy.items():
        gains = [m.gain for m in measured]
        summary[f"gain_min.{policy}"] = round(min(gains), 3)
        summary[f"gain_median.{policy}"] = round(statistics.median(gains), 3)
        summary[f"worst_min.{policy}"] = round(min(m.worst for m in measured), 3)
    default = traces[0].name
    summary[f"default_ratio.{CANDIDATE}"] = round(
        float(fields[f"{default}.elastic.{CANDIDATE}"]) / float(fields[f"{default}.static"]), 3
    )
    summary["flat"] = ", ".join(flat) or "none"
    return Result(
        name="elastic-suite",
        fields={**summary, **fields},
        targets=suite_targets(CANDIDATE),
        notes=(
            f"{len(traces)} traces ({', '.join(t.name for t in traces)}), each in a static world "
            f"and one elastic world per policy ({', '.join(POLICIES)}) at once, kvCache.min 0; "
            f"the first of {', '.join(MIN_FAMILIES)} again with kvCache.min at {KV_MIN_SHARE:g} "
            "of an equal share (@min). Real processes: the numbers move with the machine's load "
            "(src/kvshare/demo/suite.py documents the traces; python -m "
            "kvshare.demo.elastic_sim runs the same suite in simulated time, the same on any "
            "machine)."
        ),
    )
