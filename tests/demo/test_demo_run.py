"""``kvshare demo`` end to end: the node agent, model-server processes, real pools.

A short run (a few seconds of trace on a 2 GiB fake GPU) through the normal entry point,
``python -m kvshare.cli demo``: it must finish, its counts must agree with the trace it
ran, no memory may be over-committed at any sample, its headline must be capacity at the
latency SLO per world (from the GPU twin, on a shortened workload), and the plot must be
written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvshare.demo import trace

GIB = 2**30


def kvshare(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo")
    done = kvshare(
        "demo",
        "--duration",
        "6",
        "--gpu-memory",
        "2Gi",
        "--models",
        "3",
        "--seed",
        "3",
        "--patience",
        "1",
        "--speed",
        "3",
        "--metrics-port",
        "0",
        "--broker-policy",
        "fair-share",
        "--broker-policy",
        "entitlement",
        "--kv-min-share",
        "0.25",
        "--capacity-duration",
        "40",
        "--output",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def test_two_broker_policies_run_side_by_side_on_the_same_trace(
    short_run: tuple[Path, str],
) -> None:
    out, stdout = short_run
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    worlds = results["worlds"]
    assert {name: w["policy"] for name, w in worlds.items()} == {
        "elastic": "fair-share",
        "elastic-entitlement": "entitlement",
    }
    offered = len(trace.load(out / "trace.json").requests)
    for world in worlds.values():
        assert world["static"]["served"] == results["static"]["served"]
        assert world["elastic"]["offered"] == offered
    assert "Elastic under broker policy entitlement: served" in stdout
    # kvCache.min at a quarter of an equal share: no elastic lease ever went below it.
    share = 2 * GIB // 3
    for server in results["servers"]:
        if server["mode"] == "elastic":
            assert min(s["lease"] for s in server["samples"]) >= share // 4
    # Each elastic world had its own node agent, with its own policy and its own logs.
    logs = sorted(p.name for p in out.glob("server-elastic*-0.log"))
    assert logs == ["server-elastic-0.log", "server-elastic-entitlement-0.log"]


def test_a_short_demo_prints_the_comparison_and_writes_the_plot(
    short_run: tuple[Path, str],
) -> None:
    out, stdout = short_run
    assert "The live run: same trace (" in stdout and "same 2 GiB GPU" in stdout
    for row in ("static   model-0", "static   total", "elastic  model-2", "elastic  total"):
        assert row in stdout
    assert "0 over-commitments" in stdout
    assert "`kvshare demo --engine vllm` runs the comparison with real vLLM servers" in stdout
    png = out / "kvshare-demo.png"
    assert f"Plot:    {png}" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Not a terminal: progress came as plain lines, not ANSI redraws.
    assert "\x1b[" not in stdout and "[  " in stdout


def test_the_headline_is_capacity_at_the_slo_per_world(short_run: tuple[Path, str]) -> None:
    out, stdout = short_run
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    capacity = results["capacity"]
    worlds = ["static", "first-come", "kvshare:entitlement", "pooled-bound"]
    assert list(capacity["capacity"]) == worlds and list(capacity["curves"]) == worlds
    assert capacity["workload"].startswith("fleet-onoff-8b-")
    # The headline comes first, the live run's overload counts after it.
    head = stdout.index("Capacity at the latency SLO (p99 TTFT <= 2 s")
    assert head < stdout.index("The live run: same trace (")
    for world in worlds:
        assert f"  {world:<22} {capacity['capacity'][world]:6.2f}x load" in stdout
    assert "Elastic served" not in stdout
    # No way of sharing memory beats one pool any engine takes from at once, and every
    # curve is attainment (a share) at the same load scales.
    assert max(capacity["capacity"].values()) <= capacity["capacity"]["pooled-bound"] * 1.03
    scales = {tuple(s for s, _ in curve) for curve in capacity["curves"].values()}
    assert len(scales) == 1
    assert all(0 <= a <= 1 for curve in capacity["curves"].values() for _, a in curve)


def test_served_counts_agree_with_the_trace_that_ran(short_run: tuple[Path, str]) -> None:
    out, _ = short_run
    ran = trace.load(out / "trace.json")
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert results["problems"] == []
    per_model = results["per_model"]
    assert len(per_model) == 2 * ran.config.models
    for summary in per_model:
        offered = len(ran.for_model(summary["model"]))
        assert summary["offered"] == offered
        assert 0 <= summary["served"] + summary["abandoned"] <= summary["arrived"] <= offered
    for mode in ("static", "elastic"):
        mine = [s for s in per_model if s["mode"] == mode]
        assert results[mode]["served"] == sum(s["served"] for s in mine) > 0
        assert results[mode]["abandoned"] == sum(s["abandoned"] for s in mine)
        assert results[mode]["offered"] == len(ran.requests)
    # Every client that gave up waited exactly its patience, which the trace file carries.
    assert ran.config.patience_s == 1.0
    for server in results["servers"]:
        gave_up = sum(1 for wait in server["waits_s"] if wait == ran.config.patience_s)
        assert gave_up >= server["abandoned"]
        assert all(wait <= ran.config.patience_s for wait in server["waits_s"])
    assert results["static"]["abandoned"] > 0, "a 1 s patience loses part of a burst"
    # Every server ran the whole trace on the trace's clock, three times as fast as the wall.
    assert results["speed"] == 3.0
    assert all(s["samples"][-1]["t"] == ran.config.duration_s for s in results["servers"])
    # What the trace allows, simulated from the same trace file, is in the results.
    bound = results["bound"]
    assert len(bound["partitioned"]) == len(bound["shared"]) == ran.config.models
    assert sum(bound["shared"]) >= sum(bound["partitioned"])


def test_no_memory_is_over_committed_at_any_sample(short_run: tuple[Path, str]) -> None:
    out, _ = short_run
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    gpu = 2 * GIB
    assert results["pool_violations"] == [] and results["broker_violations"] == []
    # Rechecked here from the raw samples: the broker's books (read at one instant) and
    # the static partitions never exceed the GPU; no pool grows beyond its lease.
    assert results["broker_checks"] > 0
    assert results["elastic_kv_series"]
    assert all(booked <= gpu for _, booked in results["elastic_kv_series"])
    servers = results["servers"]
    static = [s for s in servers if s["mode"] == "static"]
    assert sum(max(x["lease"] for x in s["samples"]) for s in static) <= gpu
    for server in servers:
        assert server["samples"], server["mode"]
        previous = 0
        for sample in server["samples"]:
            assert sample["held"] <= previous or sample["held"] <= sample["lease_peak"]
            previous = sample["held"]


def test_elastic_pools_were_leased_by_the_broker(short_run: tuple[Path, str]) -> None:
    out, _ = short_run
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    elastic = [s for s in results["servers"] if s["mode"] == "elastic"]
    static = [s for s in results["servers"] if s["mode"] == "static"]
    share = 2 * GIB // 3
    assert all(x["lease"] == share for s in static for x in s["samples"])
    # Elastic leases move with demand: not one fixed share.
    assert len({x["lease"] for s in elastic for x in s["samples"]}) > 1


def test_trace_fixes_the_size_of_the_run(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.save(trace.generate(trace.TraceConfig(duration_s=5)), path)
    done = kvshare("demo", "--trace", str(path), "--duration", "10")
    assert done.returncode == 1
    assert "--duration cannot be combined with --trace" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "2"], "--models must be at least 3"),
        (["--patience", "0"], "--patience must be > 0"),
        (["--cycles", "0"], "--cycles must be at least 1"),
        (["--gpu-memory", "lots"], "--gpu-memory"),
        (["--trace", "/nonexistent/trace.json"], "cannot read trace"),
        (["--engine", "vllm", "--speed", "4"], "--engine vllm runs the trace in real time"),
        (["--capacity", "bogus"], "--capacity must be none or one of fleet-onoff"),
        (["--capacity-duration", "0"], "--capacity-duration must be in (0, 3600]"),
    ],
)
def test_bad_options_are_refused_with_the_reason(args: list[str], message: str) -> None:
    done = kvshare("demo", *args)
    assert done.returncode != 0
    assert message in done.stderr
