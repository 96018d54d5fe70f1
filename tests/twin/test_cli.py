"""``python -m kvshare.twin``: capacity per world of a family's workload, runs at one scale,
models per GPU, and a clear word when the workload generators are missing.

The families module (``kvshare.twin.families``) is another part's; here a stand-in with
its ``generate`` signature returns one of the tests' own small workloads."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvshare.twin import cli
from tests.twin.helpers import onoff


def _families(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    calls: list[dict[str, object]] = []

    def generate(family: str, **kwargs: object) -> object:
        calls.append({"family": family, **kwargs})
        models = kwargs.get("n_models") or 2
        return onoff(models=int(models), gpu="l40s", duration_s=10.0, busy_rps=2.0)  # type: ignore[call-overload]

    stand_in = types.ModuleType("kvshare.twin.families")
    stand_in.generate = generate  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvshare.twin.families", stand_in)
    return calls


def test_it_prints_every_worlds_capacity_and_a_json_object_last(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _families(monkeypatch)
    assert cli.main(["--family", "fleet-onoff", "--seed", "3", "--precision", "0.1", "--json"]) == 0
    assert calls[0] == {
        "family": "fleet-onoff",
        "seed": 3,
        "gpu": "h200_sxm",
        "model_class": "8b",
        "n_models": None,
        "duration_s": None,
    }
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    worlds = report["capacity"]
    assert list(worlds) == ["static", "first-come", "kvshare:entitlement", "pooled-bound"]
    assert worlds["pooled-bound"]["scale"] >= worlds["static"]["scale"] > 0
    assert any(line.startswith("kvshare:entitlement") for line in out)


def test_at_one_scale_it_prints_what_each_world_got(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _families(monkeypatch)
    code = cli.main(["--family", "x", "--scale", "1", "--policy", "fair-share", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(report["runs"]) == {"static", "first-come", "kvshare:fair-share", "pooled-bound"}
    assert all("ttft_p99_s" in run for run in report["runs"].values())


def test_models_per_gpu_asks_the_family_for_more_models(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _families(monkeypatch)
    cli.main(["--family", "x", "--scale", "1", "--models-per-gpu", "--n-models", "2", "--json"])
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    # Two 8B models fill an L40S: a third does not fit.
    assert {entry["models"] for entry in report["models_per_gpu"].values()} <= {1, 2}
    assert {call["n_models"] for call in calls} >= {2, 3}


def test_without_the_workload_generators_it_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kvshare.twin.families", None)
    with pytest.raises(SystemExit, match=r"kvshare\.twin\.families is not in this installation"):
        cli.main(["--family", "x"])


def test_bad_options_are_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--family", "x", "--kv-min-share", "2"]) == 2
    assert "kv_min_share" in capsys.readouterr().out
