"""The capacity benchmark's report: a person reads a summary and a row per workload; the
many per-workload fields stay in the JSON."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))

from capacity_report import gain_shares, markdown  # noqa: E402
from harness import Result, Target  # noqa: E402
from report import write_report  # noqa: E402

WORLDS = ["static", "first-come", "kvshare:entitlement", "pooled-bound"]
KV = "kvshare:entitlement"


def _row(name: str, seed: int, scales: list[float], per_layer: float | None) -> dict[str, object]:
    return {
        "workload": name,
        "family": "fleet-onoff",
        "class": "8b",
        "seed": seed,
        "requests": 100,
        "scales": dict(zip(WORLDS, scales, strict=True)),
        "per_layer": {"first-come": scales[1], KV: per_layer} if per_layer else {},
    }


ROWS = [
    # the bound gains 1.0 over static; kvshare gets 0.8 of it, below first-come
    _row("fleet-onoff-8b-s0", 0, [1.0, 1.9, 1.8, 2.0], 1.5),
    # the bound gains only 5 %: no per-workload gain target there
    _row("fleet-onoff-8b-s1", 1, [1.0, 1.05, 1.04, 1.05], None),
]


def test_gain_shares_count_only_workloads_where_the_bound_gains_enough_for_the_target() -> None:
    every, binding = gain_shares(ROWS, KV, 1.10)
    assert [round(g, 3) for g in every] == [0.8, 0.8]
    assert [round(g, 3) for g in binding] == [0.8]


def test_the_markdown_has_a_summary_a_row_per_workload_and_the_page_layouts() -> None:
    text = markdown(
        ROWS,
        [{"family": "fleet-onoff", "class": "8b", "models": dict.fromkeys(WORLDS, 6)}],
        worlds=WORLDS,
        kvshare=KV,
        bound_gains=1.10,
        fleet=48,
        fleet_gpus=lambda per_gpu, fleet: -(-fleet // per_gpu),
    )
    lines = text.splitlines()
    summary = next(line for line in lines if line.startswith("| 8b |"))
    # least kvshare/static 1.04, least kvshare/first-come 1.8/1.9, median gain share 0.8
    assert summary.split(" | ")[1:6] == ["2", "1.040", "0.947", "0.80", "0.80"]
    assert any(line.startswith("| fleet-onoff-8b-s0 | 100 | 1.000 | 1.900 |") for line in lines)
    assert any(line.startswith("| fleet-onoff-8b-s1 |") for line in lines)
    # per-layer pages: kvshare 1.5 against 1.8 with block-outer pages
    assert "| fleet-onoff-8b-s0 | 1.000 | 0.833 | 0.50 |" in lines
    assert "| fleet-onoff, 8b | 6 (8 GPUs) |" in text


def test_the_report_shows_the_tables_and_keeps_detail_fields_out(tmp_path: Path) -> None:
    result = Result(
        name="capacity",
        fields={"kvshare_over_static_min.8b": 1.04, "scales.fleet-onoff-8b-s0": "static=1"},
        targets=[Target("kvshare_over_static_min.8b", ">=", 0.98)],
        tables="| a table | for a person |\n|---|---|\n",
        detail_prefixes=("scales.",),
    )
    path = tmp_path / "BENCHMARKS.md"
    write_report(path, [result], machine="m", date="d", command="python bench/run.py capacity")
    text = path.read_text()
    assert text.index("| a table |") < text.index("`kvshare_over_static_min.8b`")
    assert "scales." not in text


def test_a_plot_per_family_is_drawn_and_named_relative_to_the_report(tmp_path: Path) -> None:
    from capacity_report import plot_families

    paths = plot_families(ROWS, WORLDS, tmp_path / "img", tmp_path)
    assert paths == [Path("img/capacity-fleet-onoff.png")]
    assert (tmp_path / paths[0]).read_bytes().startswith(b"\x89PNG")
