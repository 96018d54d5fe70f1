"""Step ``gpu_tests``: the ``gpu``-marked tests (``pytest -m gpu``), run for real."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpucheck.machine import ROOT, Setup


def gpu_test_files() -> list[str]:
    """Test files that hold ``gpu``-marked tests (collecting only these keeps the check
    independent of the packages other tests need)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "mark.gpu" in text:
            files.append(str(path.relative_to(ROOT)))
    return files


def run_gpu_tests(setup: Setup) -> dict[str, Any]:
    files = gpu_test_files()
    if not files:
        return {"files": 0, "passed": 0, "failed": 0, "skipped": 0, "ok": True}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"),
                f"--junitxml={report}",
                *files,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.exists():
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, "0"))
    failed = counts["failures"] + counts["errors"]
    result: dict[str, Any] = {
        "files": len(files),
        "passed": counts["tests"] - failed - counts["skipped"],
        "failed": failed,
        "skipped": counts["skipped"],
        "ok": done.returncode in (0, 5) and failed == 0,  # 5: every test deselected
    }
    if not result["ok"]:
        result["output_tail"] = (done.stdout + done.stderr)[-3000:]
    if not setup.dry_run and result["passed"] == 0:
        result["ok"] = False
        result["why"] = "no gpu test ran on a GPU machine"
    return result
