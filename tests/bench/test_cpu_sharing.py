"""The cpu-sharing benchmark's sets of busy servers and the twin's share of each."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))

from cpu_sharing import busy_sets, twin_share  # noqa: E402


def test_every_set_of_busy_servers_is_measured_the_ones_alone_first() -> None:
    assert busy_sets(3) == [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]


def test_the_twin_splits_a_core_evenly_between_the_busy_engines_pinned_to_it() -> None:
    # Three servers on two cores: 0 and 2 share core 0, 1 has core 1.
    assert twin_share((0,), 0, 2) == 1.0
    assert twin_share((0, 1), 0, 2) == 1.0
    assert twin_share((0, 2), 2, 2) == 0.5
    assert [twin_share((0, 1, 2), i, 2) for i in range(3)] == [0.5, 1.0, 0.5]
