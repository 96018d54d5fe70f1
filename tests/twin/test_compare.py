"""Every world's capacity on one workload: the sharing worlds are tried at the same
scales, so a ratio between two of them rests on runs at the same load."""

from __future__ import annotations

import pytest

from kvshare.twin import compare
from kvshare.twin.slo import SloVerdict
from kvshare.twin.workload import Workload
from kvshare.twin.worlds import TwinOptions, WorldResult
from tests.twin.helpers import onoff

#: Each world's true threshold (load scale) in the fake runs below.
THRESHOLDS = {"pooled-bound": 2.3, "static": 0.9, "first-come": 2.2, "kvshare": 2.12}


@pytest.fixture
def fake_worlds(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[float]]:
    """Worlds that meet the SLO up to their threshold; records every scale each ran at."""
    ran: dict[str, list[float]] = {w: [] for w in THRESHOLDS}
    base = onoff(duration_s=10.0)

    def run_world(name: str, workload: Workload, options: TwinOptions) -> WorldResult:
        scale = len(workload.requests) / len(base.requests)
        ran[name].append(scale)
        met = scale <= THRESHOLDS[name]
        verdict = SloVerdict(met, len(workload.requests), 0.0, 0.0, (1.0,), 0)
        return WorldResult(name, verdict, sim_s=0.0, steps=0)

    def at_scale(self: Workload, scale: float) -> Workload:
        count = round(len(base.requests) * scale)
        return Workload(
            "w", base.gpu, base.models, base.requests[:1] * count, base.duration_s, base.slo
        )

    monkeypatch.setattr(compare, "run_world", run_world)
    monkeypatch.setattr(Workload, "at_scale", at_scale)
    return ran


def test_kvshare_is_tried_at_first_comes_capacity(fake_worlds: dict[str, list[float]]) -> None:
    found = compare.compare_worlds(
        onoff(duration_s=10.0), list(THRESHOLDS), TwinOptions(), precision=0.03
    )
    first_come = found.capacities["first-come"]
    tried = {round(s, 3) for s, _ in found.capacities["kvshare"].tried}
    # kvshare ran at first-come's capacity and at the scale where first-come missed: the
    # two searches' verdicts at the same load say which world holds more.
    assert round(first_come.scale, 3) in tried
    assert round(first_come.missed_at, 3) in tried
    assert found.ratio("kvshare", "first-come") < 1.0
    for world, threshold in THRESHOLDS.items():
        assert threshold / 1.03 <= found.scale(world) <= threshold
