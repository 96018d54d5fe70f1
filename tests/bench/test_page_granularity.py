"""The page-granularity benchmark's summary: a row per trace with both page layouts side by
side, each layout's median and least gain share, and the per-trace fields in the JSON."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))

from page_granularity import summarise  # noqa: E402


def _trace(name: str, per_layer: tuple[int, float], block_outer: tuple[int, float]) -> dict:
    fields: dict[str, float | int | str] = {}
    for label, (served, gain) in (("per-layer", per_layer), ("block-outer", block_outer)):
        fields |= {
            f"{name}.{label}.static": 100,
            f"{name}.{label}.shared": 200,
            f"{name}.{label}.elastic.entitlement": served,
            f"{name}.{label}.gain.entitlement": gain,
            f"{name}.{label}.worst.entitlement": gain + 0.5,
        }
    return fields


def test_each_layout_is_summed_up_and_each_trace_is_a_row() -> None:
    fields = {
        **_trace("a-0", (150, 0.5), (170, 0.7)),
        **_trace("b-0", (120, 0.2), (110, 0.1)),
        **_trace("c-0", (190, 0.9), (180, 0.8)),
    }
    result = summarise(["a-0", "b-0", "c-0"], fields)
    assert result.fields["gain_median.per-layer"] == 0.5
    assert result.fields["gain_median.block-outer"] == 0.7
    assert result.fields["gain_min.block-outer"] == 0.1
    assert result.fields["worst_min.per-layer"] == 0.7
    assert "| b-0 | 100 | 200 | 120 / 110 | 0.2 / 0.1 | 0.7 / 0.6 |" in result.tables
    assert all(key.startswith(result.detail_prefixes) for key in fields)
