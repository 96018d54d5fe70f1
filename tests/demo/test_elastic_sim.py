"""The elastic world in simulated time: the real books, policy and pools, deterministic."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

import pytest

from kvshare.demo import suite, trace
from kvshare.demo.bound import paged_sharing, sharing_bound
from kvshare.demo.elastic_sim import (
    PAGED_REFERENCE,
    SimOptions,
    blocks_per_page,
    main,
    simulate,
)
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.trace import TraceConfig
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY
from kvshare.runtime.pool import KVPool

SMALL = TraceConfig(duration_s=24, models=3, gpu_memory_bytes=3 * 2**30, seed=2)


def test_a_simulated_run_depends_only_on_the_trace_and_the_settings() -> None:
    made = trace.generate(SMALL)
    first = simulate(made)
    assert simulate(made) == first
    assert simulate(made, SimOptions(latency_s=0.05)) != first


def test_staggered_bursts_gain_from_elastic_memory_in_simulated_time() -> None:
    result = simulate(trace.generate(SMALL))
    assert sum(result.bound.shared) > sum(result.bound.partitioned)
    assert sum(result.served) > sum(result.bound.partitioned)
    assert 0 < result.gain_share <= 1.2
    model, ratio = result.worst_model()
    assert 0 <= model < SMALL.models and ratio > 0


def test_with_every_model_guaranteed_its_equal_share_nobody_can_borrow() -> None:
    made = trace.generate(SMALL)
    partitions = simulate(made, SimOptions(kv_min_share=1.0))
    static = sum(partitions.bound.partitioned)
    assert abs(sum(partitions.served) - static) <= 0.05 * static
    assert sum(simulate(made, SimOptions(kv_min_share=0.25)).served) > 1.05 * static


@pytest.mark.parametrize("reserve_pages", [0, 2])
def test_every_pool_keeps_the_reserve_the_options_say(reserve_pages: int) -> None:
    reserved_pages: list[int] = []

    class Reserves:
        interval_s = 0.5

        def __call__(self, pools: Sequence[KVPool], engines: Sequence[EngineSim]) -> None:
            reserved_pages.extend(p.snapshot().ready // p.geometry.page_bytes for p in pools)

    simulate(trace.generate(SMALL), SimOptions(reserve_pages=reserve_pages), watch=Reserves())
    # Pages a finished request emptied stay ready until the next maintenance pass trims
    # them: most of the time each pool holds its reserve.
    assert Counter(reserved_pages).most_common(1)[0][0] == reserve_pages


def test_the_headroom_share_is_the_entitlement_policys_setting_only() -> None:
    assert SimOptions(headroom_share=0.3).broker_policy().headroom_share == 0.3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="entitlement"):
        SimOptions(policy="fair-share", headroom_share=0.3).broker_policy()
    with pytest.raises(SystemExit):
        main(["--policy", "fair-share", "--headroom-share", "0.2"])
    with pytest.raises(ValueError, match="0-1"):
        SimOptions(headroom_share=1.5).broker_policy()
    with pytest.raises(SystemExit):
        main(["--headroom-share", "-0.1"])


def test_the_command_runs_more_seeds_than_the_suite_and_sums_them_up_per_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--family", "default", "--seeds", "3", "--diagnose", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [row["trace"] for row in out["rows"]] == ["default-0", "default-1", "default-2"]
    gains = [row["gain_share"] for row in out["rows"]]
    numbers = out["summary"][DEFAULT_POLICY]
    assert numbers["traces"] == 3 and numbers["gain_min"] == min(gains)
    assert numbers["gain_median"] == sorted(gains)[1]
    assert numbers["below_0.9"] == sum(row["worst_ratio"] < 0.9 for row in out["rows"])
    for row in out["rows"]:
        assert 0 < row["diagnosis"]["starved_share"] <= 1


def test_fixed_steps_run_the_suite_on_engines_whose_steps_cost_the_same_whatever_the_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--family", "default", "--seeds", "1", "--fixed-steps", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"][0]
    fixed = sharing_bound(suite.make("default", 0, suite.SETUP.with_fixed_steps()))
    calibrated = sharing_bound(suite.make("default", 0))
    assert (row["static"], row["shared"]) == (sum(fixed.partitioned), sum(fixed.shared))
    # Without a cost per token a bigger batch is free, so the same memory serves more.
    assert row["static"] > sum(calibrated.partitioned)


def test_a_seed_count_below_one_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--seeds", "0"])


def test_the_command_runs_seeds_from_a_first_seed_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--family", "default", "--seeds", "2", "--first-seed", "6", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert [row["trace"] for row in rows] == ["default-6", "default-7"]
    bound = sharing_bound(suite.make("default", 7))
    assert (rows[1]["static"], rows[1]["shared"]) == (sum(bound.partitioned), sum(bound.shared))


@pytest.mark.parametrize("argv", [["--first-seed", "3"], ["--seeds", "2", "--first-seed", "-1"]])
def test_a_first_seed_without_a_count_or_below_zero_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)


def test_the_paged_bound_reports_first_come_page_sharing_beside_the_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--family", "default", "--seeds", "1", "--paged-bound", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    made = suite.make("default", 0)
    bound = sharing_bound(made)
    paged = paged_sharing(made, blocks_per_page(made.config))
    static, shared = sum(bound.partitioned), sum(bound.shared)
    reference = out["summary"][PAGED_REFERENCE]
    assert reference["traces"] == 1
    assert reference["gain_mean"] == round((sum(paged) - static) / (shared - static), 3)
    assert sum(paged) < shared  # the demo's pages hold several blocks: they cost
    assert out["summary"][DEFAULT_POLICY]["traces"] == 1


def test_pools_can_run_with_pages_of_a_given_number_of_blocks() -> None:
    made = trace.generate(SMALL)
    assert blocks_per_page(SMALL) > 1
    assert blocks_per_page(SMALL, 1) == 1
    one_block = simulate(made, SimOptions(page_blocks=1))
    assert one_block != simulate(made)
    assert sum(one_block.served) > 0
    with pytest.raises(SystemExit):
        main(["--page-blocks", "0"])


def test_the_reclaim_deadline_is_the_commands_setting_in_wall_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    argv = ["--family", "default", "--seeds", "1"]
    with caplog.at_level("WARNING", logger="kvshare.deviceplugin.broker.books"):
        assert main(argv) == 0
        assert "missed its reclaim deadline" not in caplog.text
        # A deadline no pool can meet: every reclaim of memory in use misses it.
        assert main([*argv, "--reclaim-deadline", "0.0001"]) == 0
    assert "missed its reclaim deadline" in caplog.text


@pytest.mark.parametrize("argv", [["--reclaim-deadline", "0"], ["--speed", "0"]])
def test_a_deadline_or_speed_that_is_not_positive_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)


@pytest.mark.parametrize("settings", [{"speed": 0.0}, {"reclaim_deadline_s": -1.0}])
def test_options_with_a_speed_or_deadline_that_is_not_positive_are_refused(
    settings: dict[str, float],
) -> None:
    with pytest.raises(ValueError, match="must be finite and > 0"):
        SimOptions(**settings)


@pytest.mark.parametrize(
    "argv",
    [
        ["--latency", "-1"],
        ["--latency", "nan"],
        ["--speed", "inf"],
        ["--kv-min-share", "2"],
        ["--kv-min-share", "-0.5"],
        ["--reserve-pages", "-1"],
    ],
)
def test_a_setting_that_would_run_a_meaningless_world_is_refused_before_any_trace(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a NaN latency or an infinite speed stalled the clock and reported a world
    # that served nothing, and a kvCache.min share outside [0, 1] crashed mid-run.
    with pytest.raises(SystemExit):
        main(["--family", "default", "--seeds", "1", *argv])
    captured = capsys.readouterr()
    assert "default-0" not in captured.out
    assert "error:" in captured.err


@pytest.mark.parametrize(
    "settings",
    [
        {"latency_s": float("nan")},
        {"latency_s": -0.001},
        {"speed": float("inf")},
        {"kv_min_share": 1.5},
        {"page_blocks": 0},
        {"reserve_pages": -2},
    ],
)
def test_options_that_no_simulated_node_could_run_with_are_refused(
    settings: dict[str, float],
) -> None:
    with pytest.raises(ValueError, match="must be"):
        SimOptions(**settings)  # type: ignore[arg-type]


def test_a_zero_latency_and_a_full_minimum_are_settings_a_node_can_have() -> None:
    made = trace.generate(SMALL)
    assert sum(simulate(made, SimOptions(latency_s=0.0, kv_min_share=1.0)).served) > 0
