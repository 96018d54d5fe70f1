"""The benchmark harness prints one JSON object last and writes the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_placement_benchmark_prints_its_fields_as_json(tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, "bench/run.py", "placement", "--quick", "--json", "--write", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads(done.stdout.strip().splitlines()[-1])
    for field in ("replicas", "nodes", "gpus_per_node", "full_plan_s", "incremental_p50_ms"):
        assert field in payload
    assert payload["placed"] == payload["replicas"]
    text = report.read_text()
    assert "## placement" in text and "`full_plan_s`" in text and "Machine:" in text


def test_unknown_benchmark_is_refused_with_the_list() -> None:
    done = subprocess.run(
        [sys.executable, "bench/run.py", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "unknown benchmark 'nope'; available: placement" in done.stderr
