"""Benchmark ``elastic``: the demo's comparison, static partitions against kvshare.

The same seeded, bursty trace (``kvshare.demo.trace``, its defaults: 4 models with
staggered 36 s busy windows in 144 s on one 4 GiB fake GPU, a busy model asking for what the
whole GPU can serve, a quiet model for 0.1x what its static share can, clients that give up
after 10 s without a first token) runs at once in two worlds of the same total memory:
each model with a fixed equal share, and each model leased by the node agent's broker.
Real processes, real pools on the ``host`` backend, the real broker; the trace runs four
times as fast as the wall clock, which makes every delay of kvshare's count four times
over (``kvshare.demo.options.DEFAULT_SPEED``).
``ratio`` = requests served elastic / static within the same time and memory (a figure,
not a target: ``bench/elastic_targets.py``);
``*_abandoned`` = requests whose clients gave up first. ``ideal_ratio`` is what the trace
allows: the same schedulers simulated without memory, from equal partitions of blocks and
from one shared pool where a freed block is anyone's at once (``kvshare.demo.bound``).
``over_commitments`` counts moments when a pool held more than its lease or the broker's
leases summed to more than the GPU; ``overdue_reclaims`` the reclaims that missed the
broker's deadline.
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
            duration_s=36.0 if quick else DemoOptions().duration_s,
            output=Path(out),
            metrics_port=0,
            live=False,
            plot=False,
        )
        outcome = run_demo(options, sys.stderr)
    config = outcome.trace.config
    comparison = outcome.comparison
    bound = outcome.bound
    assert bound is not None, "run_demo always simulates what the trace allows"
    return Result(
        name="elastic",
        fields={
            "static_served": comparison.static.served,
            "elastic_served": comparison.elastic.served,
            "ratio": round(comparison.ratio, 3),
            "static_p95_wait_s": round(comparison.static.p95_wait_s, 3),
            "elastic_p95_wait_s": round(comparison.elastic.p95_wait_s, 3),
            "static_abandoned": comparison.static.abandoned,
            "elastic_abandoned": comparison.elastic.abandoned,
            "ideal_ratio": round(bound.ratio, 3),
            "offered": len(outcome.trace.requests),
            "over_commitments": len(outcome.pool_violations) + len(outcome.broker_violations),
            "overdue_reclaims": outcome.overdue_reclaims,
            "inconsistencies": len(outcome.problems),
        },
        targets=[
            Target("over_commitments", "<=", 0),
            Target("inconsistencies", "<=", 0),
        ],
        notes=(
            f"Trace: seed {config.seed}, {config.models} models, {config.duration_s:g} s "
            f"at x{options.speed:g} speed, {config.gpu_memory_bytes / 2**30:g} GiB GPU, a "
            f"busy model asking for {config.busy_gpu_load:g}x what the GPU serves and a "
            f"quiet one for {config.quiet_load:g}x what its static share serves, clients "
            f"leave after {config.patience_s:g} s without a first token, "
            f"{len(outcome.trace.requests)} requests; wall time {outcome.wall_s:.0f} s. "
            f"On this trace instant sharing (ideal_ratio) would serve x{bound.ratio:.2f} "
            f"the partitions' {sum(bound.partitioned)} (src/kvshare/demo/trace.py)."
        ),
    )
