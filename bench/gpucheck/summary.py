"""The check's summary: run every step, time it, and the BENCHMARKS.md section of a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpucheck.colocated import colocated_start
from gpucheck.decode import measure_decode
from gpucheck.fence import fence_check
from gpucheck.gpu_tests import run_gpu_tests
from gpucheck.machine import Setup
from gpucheck.overuse import lease_enforcement
from gpucheck.page_ops import measure_page_ops
from gpucheck.sharing import shared_compute
from gpucheck.trade import trade_memory

#: The whole check must fit in this (the device time one run may take).
BUDGET_S = 480.0

STEPS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "gpu_tests": run_gpu_tests,
    "page_ops": measure_page_ops,
    "decode": measure_decode,
    "trade": trade_memory,
    "fence": fence_check,
    "colocated_start": colocated_start,
    "lease_enforcement": lease_enforcement,
    "shared_compute": shared_compute,
}


def run_steps(setup: Setup, skip: set[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"check": "kvshare gpu-check", **setup.describe()}
    began = time.monotonic()
    for name, step in STEPS.items():
        if name in skip:
            summary[name] = {"skipped": True, "ok": True}
            continue
        start = time.monotonic()
        try:
            summary[name] = step(setup)
        except Exception as exc:
            summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        summary[name]["seconds"] = round(time.monotonic() - start, 1)
    summary["wall_s"] = round(time.monotonic() - began, 1)
    summary["within_budget"] = summary["wall_s"] <= BUDGET_S
    summary["ok"] = summary["within_budget"] and all(summary[name].get("ok") for name in STEPS)
    return summary


def gpu_section(summary: dict[str, Any], date: str, command: str) -> str:
    """The BENCHMARKS.md section of one run."""
    title = "GPU check" + (
        " (dry run: host backend, no GPU)" if summary["mode"] == "dry-run" else ""
    )
    machine = summary.get("gpu", "no GPU") + (
        f", driver {summary['driver']}" if "driver" in summary else ""
    )
    lines = [
        f"## {title}",
        "",
        f"Machine: {machine}; PyTorch {summary['torch']}, Python {summary['python']}. "
        f"Date: {date}. Command: `{command}`. Wall time {summary['wall_s']} s. "
        f"All steps passed: {'yes' if summary['ok'] else '**no**'}.",
        "",
        "| step | field | measured |",
        "|---|---|---|",
    ]
    for step in STEPS:
        for key, value in summary.get(step, {}).items():
            if key in ("output_tail",):
                continue
            lines.append(f"| {step} | `{key}` | {value} |")
    return "\n".join(lines) + "\n"
