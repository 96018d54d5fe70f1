"""``python -m kvshare.twin``: capacity per world of a generated family's workload or of a
user's files, runs at one scale, models per GPU, and clear refusals of what the twin
cannot run. The families are the real generators, kept short (a few simulated seconds,
few models, a coarse precision) so each command runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.twin import cli
from kvshare.twin.workload_files import save_workload
from tests.twin.helpers import onoff

SHORT = ["--n-models", "2", "--duration", "10", "--precision", "0.25"]


def _last_json(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], dict[str, object]]:
    out = capsys.readouterr().out.splitlines()
    return out, json.loads(out[-1])


def test_a_familys_capacity_per_world_is_printed_with_a_json_object_last(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--family", "gamma-bursts", "--model-class", "small", "--seed", "3", *SHORT]
    assert cli.main([*argv, "--json"]) == 0
    out, report = _last_json(capsys)
    assert report["workload"] == "gamma-bursts-small-2m-s3"
    worlds = report["capacity"]
    assert isinstance(worlds, dict)
    assert list(worlds) == ["static", "first-come", "kvshare:entitlement", "pooled-bound"]
    assert worlds["pooled-bound"]["scale"] >= worlds["static"]["scale"] > 0
    assert any(line.startswith("kvshare:entitlement") for line in out)


def test_at_one_scale_it_prints_what_each_world_got(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--family", "long-context", "--scale", "1", "--policy", "fair-share", *SHORT]
    assert cli.main([*argv, "--json"]) == 0
    _, report = _last_json(capsys)
    runs = report["runs"]
    assert isinstance(runs, dict)
    assert set(runs) == {"static", "first-come", "kvshare:fair-share", "pooled-bound"}
    assert all(run["met"] and run["ttft_p99_s"] < 2.0 for run in runs.values())


def test_a_users_workload_files_are_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yaml_path, _ = save_workload(onoff(models=2, duration_s=10.0, busy_rps=2.0), tmp_path)
    assert cli.main(["--workload", str(yaml_path), "--scale", "2", "--json"]) == 0
    _, report = _last_json(capsys)
    assert report["workload"] == "onoff"
    assert set(report["runs"]) == {"static", "first-come", "kvshare:entitlement", "pooled-bound"}


def test_models_per_gpu_asks_the_family_for_more_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--family", "gamma-bursts", "--gpu", "l40s", "--scale", "1", "--models-per-gpu"]
    assert cli.main([*argv, *SHORT, "--json"]) == 0
    _, report = _last_json(capsys)
    placed = report["models_per_gpu"]
    assert isinstance(placed, dict)
    # Two 8B models fill an L40S (48 GB): a third does not fit beside them.
    assert {entry["models"] for entry in placed.values()} == {2}
    assert {entry["fleet_gpus"] for entry in placed.values()} == {24}


WORKLOAD = """\
name: pair
duration_s: 10
models:
  - name: chat
    architecture: meta-llama/Llama-3.1-8B
  - name: other
    architecture: {architecture}
{extra}"""


@pytest.mark.parametrize(
    ("architecture", "extra", "problem"),
    [
        ("mistralai/Mistral-7B", "", "no config for architecture 'mistralai/Mistral-7B'"),
        ("Qwen/Qwen3-8B", "    engine: sglang\n", "step tables for the engines vllm only"),
        ("meta-llama/Llama-3.1-70B", "", "does not fit a h200_sxm"),
    ],
)
def test_a_workload_the_twin_cannot_run_is_refused_before_any_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    architecture: str,
    extra: str,
    problem: str,
) -> None:
    (tmp_path / "w.yaml").write_text(
        WORKLOAD.format(architecture=architecture, extra=extra), encoding="utf-8"
    )
    (tmp_path / "w.csv").write_text(
        "arrival_s,model,prompt_tokens,output_tokens\n0.5,chat,100,20\n1,other,100,20\n",
        encoding="utf-8",
    )
    assert cli.main(["--workload", str(tmp_path / "w.yaml")]) == 2
    out = capsys.readouterr().out
    assert problem in out and out.startswith("kvshare twin: ")
    assert "capacity" not in out


def test_bad_options_are_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--family", "diurnal", "--kv-min-share", "2"]) == 2
    assert "kv_min_share" in capsys.readouterr().out
    assert cli.main(["--family", "diurnal", "--scale", "100"]) == 2
    assert "load scale must be in" in capsys.readouterr().out
    assert cli.main(["--workload", "w.yaml", "--models-per-gpu"]) == 2
    assert "--models-per-gpu needs --family" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--family", "no-such-family"])
    with pytest.raises(SystemExit):
        cli.main(["--family", "diurnal", "--gpu", "b300_sxm"])
