"""What the demo writes and prints at the end: ``results.json`` and the comparison table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvshare.demo.options import DemoOptions, DemoOutcome
from kvshare.demo.stats import Comparison
from kvshare.demo.view import unit_of

__all__ = ["report_lines", "summary_table", "write_results"]

GIB = 2**30


def write_results(outcome: DemoOutcome, path: Path) -> None:
    """``results.json``: the trace's settings, every world's comparison and every server."""
    payload = {
        "trace": asdict(outcome.trace.config),
        "ratio": outcome.comparison.ratio,
        "per_model": [asdict(s) for s in outcome.comparison.per_model],
        "static": asdict(outcome.comparison.static),
        "elastic": asdict(outcome.comparison.elastic),
        "pool_violations": [asdict(v) for v in outcome.pool_violations],
        "broker_violations": [asdict(v) for v in outcome.broker_violations],
        "broker_checks": outcome.broker_checks,
        "overdue_reclaims": outcome.overdue_reclaims,
        "bound": asdict(outcome.bound) if outcome.bound is not None else None,
        "capacity": asdict(outcome.capacity) if outcome.capacity is not None else None,
        "problems": outcome.problems,
        "wall_s": outcome.wall_s,
        "speed": outcome.speed,
        "elastic_kv_series": outcome.elastic_kv_series,
        "worlds": {
            name: {
                "policy": outcome.policies.get(name),
                "ratio": comparison.ratio,
                "static": asdict(comparison.static),
                "elastic": asdict(comparison.elastic),
                "per_model": [asdict(s) for s in comparison.per_model],
            }
            for name, comparison in outcome.comparisons.items()
        },
        "servers": [asdict(r) for r in outcome.results],
    }
    path.write_text(json.dumps(payload) + "\n", encoding="utf-8")


def summary_table(comparison: Comparison, gpu_bytes: int = GIB) -> list[str]:
    """The end-of-run table, per model and in total, both modes (KV in GiB, or in MiB
    on a GPU smaller than one)."""
    unit, name = unit_of(gpu_bytes)
    header = (
        f"{'run':<8} {'model':<8} {'served':>7} {'gave up':>7} {'offered':>7} {'p50 wait':>9} "
        f"{'p95 wait':>9} {'peak KV':>9} {'mean KV':>9} {'mean used':>9} {'preempt':>7} "
        f"{'reclaims':>8}"
    )
    lines = [header, "-" * len(header)]
    rows: Sequence[Any] = [
        *[s for s in comparison.per_model if s.mode == "static"],
        comparison.static,
        *[s for s in comparison.per_model if s.mode == "elastic"],
        comparison.elastic,
    ]
    for row in rows:
        model = "total" if row.model is None else f"model-{row.model}"
        lines.append(
            f"{row.mode:<8} {model:<8} {row.served:>7} {row.abandoned:>7} {row.offered:>7} "
            f"{row.p50_wait_s:>8.2f}s {row.p95_wait_s:>8.2f}s "
            f"{row.peak_kv / unit:>5.2f} {name} {row.mean_kv / unit:>5.2f} {name} "
            f"{row.mean_used / unit:>5.2f} {name} "
            f"{row.preemptions:>7} {row.reclaims:>8}"
        )
        if row.model is None:
            lines.append("")
    return lines


def _bound_lines(outcome: DemoOutcome) -> list[str]:
    bound = outcome.bound
    if bound is None:
        return []
    return [
        f"What this trace allows (the same schedulers simulated without memory): "
        f"{sum(bound.partitioned)} served from partitions, {sum(bound.shared)} if every "
        f"freed block went to any model at once: x{bound.ratio:.2f}.",
    ]


def _other_world_lines(outcome: DemoOutcome) -> list[str]:
    """One line per elastic world beyond the first (the table shows the first)."""
    lines = []
    for name, comparison in list(outcome.comparisons.items())[1:]:
        policy = outcome.policies.get(name) or "the default"
        lines.append(
            f"Elastic under broker policy {policy}: served {comparison.elastic.served}, "
            f"x{comparison.ratio:.2f}; gave up {comparison.elastic.abandoned}; p95 queueing "
            f"delay {comparison.elastic.p95_wait_s:.2f} s."
        )
    return lines


def report_lines(outcome: DemoOutcome, options: DemoOptions) -> list[str]:
    """What the demo prints at the end: the table, the verdict, the checks, the files."""
    config = outcome.trace.config
    comparison = outcome.comparison
    violations = [*outcome.broker_violations, *outcome.pool_violations]
    engines = "real vLLM servers" if options.engine == "vllm" else "simulated engines"
    unit, unit_name = unit_of(config.gpu_memory_bytes)
    headline = []
    if outcome.capacity is not None:
        from kvshare.demo.capacity import capacity_lines

        headline = ["", *capacity_lines(outcome.capacity)]
    lines = [
        *headline,
        "",
        f"The live run: same trace ({len(outcome.trace.requests)} requests, "
        f"{config.models} models, "
        f"{config.duration_s:g} s), same {config.gpu_memory_bytes / unit:g} {unit_name} GPU, "
        f"{engines}, the real node agent and KV pools (in overload, by design: the counts "
        "show memory moving, not capacity):",
        "",
        *summary_table(comparison, config.gpu_memory_bytes),
        *_bound_lines(outcome),
        *_other_world_lines(outcome),
        f"Memory books: {outcome.broker_checks} snapshots of the broker's books and every "
        f"pool sample checked: {len(violations)} over-commitments. Reclaims past the "
        f"broker's deadline: {outcome.overdue_reclaims}.",
    ]
    if outcome.plot is not None:
        lines.append(f"Plot:    {outcome.plot}")
    lines += [
        f"Results: {outcome.summary} (the trace is {options.output / 'trace.json'}; "
        "--trace runs it again)",
        f"Metrics were served at {outcome.metrics_url}. Wall time {outcome.wall_s:.0f} s.",
    ]
    if options.engine == "sim":
        lines.append(
            "These were simulated engines; `kvshare demo --engine vllm` runs the comparison "
            "with real vLLM servers (vLLM's CPU build, set up by `make engines`)."
        )
    lines += [f"PROBLEM: {problem}" for problem in outcome.problems]
    lines += [f"OVER-COMMITTED at {v.t:.2f} s: {v.what}" for v in violations[:10]]
    return lines
