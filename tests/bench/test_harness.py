"""The benchmark harness prints one JSON object last and writes the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "elastic-suite" in done.stderr  # bench/elastic_suite.py: dashes are underscores


def _bench_module(name: str) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    sys.path.append(str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_the_report_says_which_benchmarks_ran_and_keeps_the_gpu_section(tmp_path: Path) -> None:
    report = _bench_module("report")
    harness = _bench_module("harness")
    path = tmp_path / "BENCHMARKS.md"
    result = harness.Result(
        "placement", {"full_plan_s": 0.5}, [harness.Target("full_plan_s", "<=", 2.0)]
    )  # type: ignore[attr-defined]
    report.write_gpu_section(path, "## GPU check\n\nmeasured on a GPU\n")  # type: ignore[attr-defined]
    report.write_report(  # type: ignore[attr-defined]
        path, [result], machine="m", date="d", command="python bench/run.py --all", missing=["vmm"]
    )
    text = path.read_text()
    assert "Run: `placement`. Not present in this checkout, so not run: `vmm`." in text
    assert "## placement" in text and "Command: `python bench/run.py placement`" in text
    assert text.rstrip().endswith("measured on a GPU")
    report.write_gpu_section(path, "## GPU check\n\nagain\n")  # type: ignore[attr-defined]
    text = path.read_text()
    assert "## placement" in text and "again" in text and "measured on a GPU" not in text


def test_a_benchmark_that_raises_is_reported_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import types

    run = _bench_module("run")
    report = _bench_module("report")
    harness = _bench_module("harness")

    def explode(quick: bool) -> object:
        raise RuntimeError("the bench lost its broker")

    crashed = run.run_one(types.SimpleNamespace(run=explode), "broker", quick=True)  # type: ignore[attr-defined]
    assert crashed.crashed and crashed.fields == {
        "error": "RuntimeError: the bench lost its broker"
    }
    assert (
        "the bench lost its broker" in capsys.readouterr().err
    )  # the traceback, for whoever runs it
    fine = harness.Result("placement", {"full_plan_s": 0.5})  # type: ignore[attr-defined]
    path = tmp_path / "BENCHMARKS.md"
    report.write_report(path, [fine, crashed], machine="m", date="d", command="c")  # type: ignore[attr-defined]
    text = path.read_text()
    assert "Failed with an error (see its table): `broker`." in text
    assert "| `error` | RuntimeError: the bench lost its broker | | |" in text


def test_a_report_without_a_gpu_run_says_so(tmp_path: Path) -> None:
    report = _bench_module("report")
    harness = _bench_module("harness")
    path = tmp_path / "BENCHMARKS.md"
    fine = harness.Result("placement", {"full_plan_s": 0.5})  # type: ignore[attr-defined]
    report.write_report(path, [fine], machine="m", date="d", command="c")  # type: ignore[attr-defined]
    assert "## GPU check\n\nNot run yet: `make gpu-check`" in path.read_text()


def test_a_benchmark_re_run_on_its_own_replaces_only_its_table(tmp_path: Path) -> None:
    report = _bench_module("report")
    harness = _bench_module("harness")
    path = tmp_path / "BENCHMARKS.md"
    order = ("placement", "vmm", "broker")
    first = [
        harness.Result("placement", {"full_plan_s": 0.5}),  # type: ignore[attr-defined]
        harness.Result("broker", {"grant_rtt_p50_us": 400.0}),  # type: ignore[attr-defined]
    ]
    report.write_gpu_section(path, "## GPU check\n\nmeasured on a GPU\n")  # type: ignore[attr-defined]
    report.write_report(path, first, machine="m", date="d1", command="c --all", order=order)  # type: ignore[attr-defined]
    again = harness.Result("broker", {"grant_rtt_p50_us": 104.0})  # type: ignore[attr-defined]
    vmm = harness.Result("vmm", {"ratio": 1.3})  # type: ignore[attr-defined]
    report.write_report(  # type: ignore[attr-defined]
        path, [again, vmm], machine="m", date="d2", command="c --all", keep_others=True, order=order
    )
    text = path.read_text()
    assert "Run: `placement`, `vmm`, `broker`." in text
    assert text.index("## placement") < text.index("## vmm") < text.index("## broker")
    assert "| `full_plan_s` | 0.5 | | |" in text and "Date: d1." in text
    assert "| `grant_rtt_p50_us` | 104 | | |" in text and "400" not in text
    assert text.count("## broker") == 1 and text.rstrip().endswith("measured on a GPU")


def test_a_field_with_a_range_of_targets_meets_it_only_within_both_ends(tmp_path: Path) -> None:
    report = _bench_module("report")
    harness = _bench_module("harness")
    path = tmp_path / "BENCHMARKS.md"
    low, high = harness.Target("ratio", ">=", 0.95), harness.Target("ratio", "<=", 1.05)  # type: ignore[attr-defined]
    below = harness.Result("elastic-vllm", {"ratio": 0.81}, [low, high])  # type: ignore[attr-defined]
    report.write_report(path, [below], machine="m", date="d", command="c")  # type: ignore[attr-defined]
    assert "| `ratio` | 0.81 | >= 0.95 and <= 1.05 | **no** |" in path.read_text()
    within = harness.Result("elastic-vllm", {"ratio": 1.02}, [low, high])  # type: ignore[attr-defined]
    report.write_report(path, [within], machine="m", date="d", command="c")  # type: ignore[attr-defined]
    assert "| `ratio` | 1.02 | >= 0.95 and <= 1.05 | yes |" in path.read_text()
