"""The twin check judges the twin against the median of several real runs and shows their spread."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import cast

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))

from kvshare.demo.options import DemoOutcome  # noqa: E402
from twin_check import real_fields  # noqa: E402


def _run(static_served: int, elastic_served: int, wait_s: float) -> DemoOutcome:
    """One real run of both worlds: three servers each, ``wait_s`` every request's wait."""

    def world(mode: str) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(
                mode=mode,
                steps=100,
                cpu_s={"worker": 1.0, "engine_core": 0.5, "api": 0.25},
                waits_s=[wait_s] * 10,
            )
            for _ in range(3)
        ]

    comparison = SimpleNamespace(
        static=SimpleNamespace(served=static_served, abandoned=1000 - static_served),
        elastic=SimpleNamespace(served=elastic_served, abandoned=1000 - elastic_served),
    )
    results = world("static") + world("elastic")
    return cast(DemoOutcome, SimpleNamespace(comparison=comparison, results=results))


def test_each_world_is_the_median_run_beside_its_lowest_and_highest() -> None:
    fields = real_fields([_run(500, 350, 4.0), _run(450, 560, 5.0), _run(550, 450, 3.0)])
    assert fields["real_runs"] == 3
    assert fields["real_static_served"] == 500
    assert fields["real_elastic_served"] == 450
    assert fields["real_elastic_abandoned"] == 550
    assert fields["real_elastic_ttft_p50_s"] == 4.0
    assert (fields["real_elastic_served_lowest"], fields["real_elastic_served_highest"]) == (
        350,
        560,
    )
    assert fields["real_elastic_served_spread"] == round((560 - 350) / 450, 3)
    assert fields["real_static_served_spread"] == 0.2
    # 300 steps per world and run; 3 s of worker CPU over them.
    assert fields["real_static_steps"] == 300
    assert fields["real_static_worker_ms_per_step"] == 10.0


def test_a_single_run_is_its_own_median_with_no_spread() -> None:
    fields = real_fields([_run(480, 520, 5.0)])
    assert fields["real_static_served"] == 480
    assert fields["real_elastic_served_spread"] == 0.0
