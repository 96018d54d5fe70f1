"""Benchmark ``elastic``: the demo's comparison, static partitions against kvshare.

The same seeded, bursty trace (``kvshare.demo.trace``, its defaults: 3 models with
staggered busy windows in 36 s on one 4 GiB fake GPU, a busy model's load 3x what its static
share can serve, a quiet model's 0.1x) runs at once in two worlds of the same total
memory: each model with a fixed equal share, and each model leased by the node agent's
broker. Real processes, real pools on the ``host`` backend, the real broker.
``ratio`` = requests served elastic / static within the same time and memory.
``over_commitments`` counts moments when a pool held more than its lease or the broker's
leases summed to more than the GPU.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness import Result, Target
from kvshare.demo.orchestrator import DemoOptions, run_demo


def run(quick: bool) -> Result:
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-elastic-") as out:
        options = DemoOptions(
            duration_s=18.0 if quick else DemoOptions().duration_s,
            output=Path(out),
            metrics_port=0,
            live=False,
            plot=False,
        )
        outcome = run_demo(options, sys.stderr)
    config = outcome.trace.config
    comparison = outcome.comparison
    return Result(
        name="elastic",
        fields={
            "static_served": comparison.static.served,
            "elastic_served": comparison.elastic.served,
            "ratio": round(comparison.ratio, 3),
            "static_p95_wait_s": round(comparison.static.p95_wait_s, 3),
            "elastic_p95_wait_s": round(comparison.elastic.p95_wait_s, 3),
            "offered": len(outcome.trace.requests),
            "over_commitments": len(outcome.pool_violations) + len(outcome.broker_violations),
            "inconsistencies": len(outcome.problems),
        },
        targets=[
            Target("ratio", ">=", 1.5),
            Target("over_commitments", "<=", 0),
            Target("inconsistencies", "<=", 0),
        ],
        notes=(
            f"Trace: seed {config.seed}, {config.models} models, {config.duration_s:g} s, "
            f"{config.gpu_memory_bytes / 2**30:g} GiB GPU, busy load {config.busy_load:g}x "
            f"and quiet load {config.quiet_load:g}x a static share's capacity, "
            f"{len(outcome.trace.requests)} requests; wall time {outcome.wall_s:.0f} s. "
            f"With one staggered burst per model, no scheme can serve more than "
            f"2M/(M+1) = x{2 * config.models / (config.models + 1):.2f} the static world's "
            "requests within the run (src/kvshare/demo/trace.py)."
        ),
    )
