"""The runtime benchmarks run in their quick form and print the fields their targets name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("vmm", ("raw_map_unmap_us", "pool_map_unmap_us", "ratio", "create_release_us")),
        ("blocks", ("alloc_free_blocks_per_s", "waits_fraction", "growth_allocations")),
    ],
)
def test_quick_runtime_benchmark_prints_its_fields(name: str, fields: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, "bench/run.py", name, "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a target missed on a loaded machine
    payload = json.loads(done.stdout.strip().splitlines()[-1])
    assert payload["name"] == name
    for field in fields:
        assert isinstance(payload[field], int | float) and payload[field] >= 0
