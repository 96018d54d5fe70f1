"""``make gpu-check`` without a GPU: it refuses clearly, and its dry run works end to end.

The dry run is the check's own test here: every step runs for real on the host backend
(page operations against libc, the decoder on the CPU, the node agent and two worker
processes trading memory, a kernel on the host stream racing an unmap, two workers starting
together through the broker, the node agent on a fake NVML catching a worker over its
lease, two decoders sharing the cores), only the GPU is absent. On a GPU machine the same
script runs the ``cuda`` backend instead. ``make gpu-check --dry-run`` runs the same dry run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def has_nvidia_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(has_nvidia_driver(), reason="this machine has an NVIDIA driver")
def test_without_a_gpu_the_check_stops_at_once_and_says_why() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3
    assert "gpu-check: no GPU on this machine: no NVIDIA driver" in done.stderr
    assert "make gpu-check --dry-run" in done.stderr
    assert done.stdout == ""


@pytest.mark.timeout(600)
def test_the_dry_run_exercises_every_step_and_records_them(tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\n## placement\n\nkept\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--write", str(report)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "dry-run" and summary["backend"] == "host"
    assert summary["ok"] is True
    assert summary["gpu_tests"]["failed"] == 0
    pages = summary["page_ops"]
    for field in ("create_us", "bare_create_us", "map_us", "bare_map_us", "unmap_us"):
        assert pages[field] > 0, field
    assert summary["decode"]["pool_tokens_per_s"] > 0 < summary["decode"]["plain_tokens_per_s"]
    for field in ("pool_create_us", "pool_map_us", "pool_unmap_us", "pool_release_us"):
        assert pages[field] > 0, field
    fence = summary["fence"]
    assert fence["kernel_done_before_unmap"] is True and fence["read_ok"] is True
    start = summary["colocated_start"]
    assert start["kv_blocks"] == [16, 16] and start["second_turn_wait_s"] >= 0
    assert summary["within_budget"] is True
    enforcement = summary["lease_enforcement"]
    assert enforcement["overuse_within_charge"] == 0 and enforcement["detected_s"] is not None
    assert enforcement["lease_after_bytes"] < enforcement["lease_before_bytes"]
    trade = summary["trade"]
    assert trade["b_blocks_verified"] is True
    assert trade["b_held_bytes"] >= trade["budget_bytes"] // 4
    assert trade["a_at_end_bytes"] + trade["b_held_bytes"] <= trade["budget_bytes"]
    shared = summary["shared_compute"]
    assert shared["step_ms_alone"] > 0 and len(shared["step_ms_together"]) == 2
    assert shared["stretch"] > 0 and shared["twin_stretch"] == 2.0
    text = report.read_text()
    assert "kept" in text
    assert "## GPU check (dry run: host backend, no GPU)" in text
    assert "| trade | `b_blocks_verified` | True |" in text


def test_make_gpu_check_dry_run_runs_the_dry_run_instead_of_printing_the_command() -> None:
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-n",
            "gpu-check",
            "GPU_CHECK_ARGS=--skip gpu_tests --skip page_ops --skip decode --skip trade "
            "--skip colocated_start --skip lease_enforcement --skip shared_compute",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "dry-run" and summary["fence"]["ok"] is True
