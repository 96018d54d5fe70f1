"""The ``capacity`` benchmark's results as a person reads them: markdown tables and a plot
per family.

A row of the suite (:func:`capacity.measure` makes them) is a dict: ``workload``,
``family``, ``class``, ``seed``, ``requests``, ``scales`` (world -> capacity as a load
scale), ``per_layer`` (world -> capacity with per-layer pages, seed 0 only). A placement
is ``family``, ``class`` and ``models`` (world -> the most models one GPU serves).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["gain_share", "gain_shares", "markdown", "plot_families", "ratio"]


def gain_share(scales: dict[str, float], world: str) -> float | None:
    """The share of the pooled bound's gain over static that ``world`` captured, or None
    where the bound gains nothing."""
    static, bound = scales["static"], scales["pooled-bound"]
    if bound <= static:
        return None
    return (scales[world] - static) / (bound - static)


def ratio(scales: dict[str, float], world: str, baseline: str) -> float:
    """``world``'s capacity over ``baseline``'s."""
    base = scales[baseline]
    return scales[world] / base if base else math.inf


def gain_shares(
    rows: Sequence[dict[str, Any]], world: str, bound_gains: float
) -> tuple[list[float], list[float]]:
    """``world``'s gain shares over ``rows`` where the bound gains anything, and those
    where the bound exceeds static by ``bound_gains`` or more (where the target holds)."""
    every, binding = [], []
    for row in rows:
        share = gain_share(row["scales"], world)
        if share is None:
            continue
        every.append(share)
        if row["scales"]["pooled-bound"] >= bound_gains * row["scales"]["static"]:
            binding.append(share)
    return every, binding


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _summary(rows: Sequence[dict[str, Any]], kvshare: str, bound_gains: float) -> list[str]:
    lines = [
        "| models | workloads | kvshare / static, least | kvshare / first-come, least "
        f"| gain share, median | gain share, least where the bound is >= {bound_gains:g}x static "
        "| per-layer / block-outer pages, median |",
        "|---|---|---|---|---|---|---|",
    ]
    for model_class in sorted({r["class"] for r in rows}):
        mine = [r for r in rows if r["class"] == model_class]
        gains, binding = gain_shares(mine, kvshare, bound_gains)
        layered = [r["per_layer"][kvshare] / r["scales"][kvshare] for r in mine if r["per_layer"]]
        cells = [
            model_class,
            str(len(mine)),
            _cell(min(ratio(r["scales"], kvshare, "static") for r in mine), 3),
            _cell(min(ratio(r["scales"], kvshare, "first-come") for r in mine), 3),
            _cell(statistics.median(gains) if gains else None),
            _cell(min(binding) if binding else None),
            _cell(statistics.median(layered) if layered else None, 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _workloads(rows: Sequence[dict[str, Any]], worlds: Sequence[str], kvshare: str) -> list[str]:
    names = [w.replace("kvshare:", "kvshare ") for w in worlds]
    lines = [
        "| workload | requests | " + " | ".join(names) + " | kvshare / static "
        "| kvshare / first-come | gain share |",
        "|---|---|" + "---|" * (len(worlds) + 3),
    ]
    for row in rows:
        scales = row["scales"]
        cells = [row["workload"], str(row["requests"])]
        cells += [f"{scales[w]:.3f}" for w in worlds]
        cells += [
            _cell(ratio(scales, kvshare, "static"), 3),
            _cell(ratio(scales, kvshare, "first-come"), 3),
            _cell(gain_share(scales, kvshare)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _pages(rows: Sequence[dict[str, Any]], kvshare: str) -> list[str]:
    lines = [
        "| workload | first-come, per-layer / block-outer | kvshare, per-layer / block-outer "
        "| gain share with per-layer pages |",
        "|---|---|---|---|",
    ]
    for row in rows:
        layered = row["per_layer"]
        if not layered:
            continue
        scales = row["scales"]
        cells = [
            row["workload"],
            f"{layered['first-come'] / scales['first-come']:.3f}",
            f"{layered[kvshare] / scales[kvshare]:.3f}",
            _cell(gain_share({**scales, kvshare: layered[kvshare]}, kvshare)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _placements(
    placements: Sequence[dict[str, Any]], worlds: Sequence[str], fleet: int, fleet_gpus: Any
) -> list[str]:
    names = [w.replace("kvshare:", "kvshare ") for w in worlds]
    lines = [
        "| family, models | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(worlds),
    ]
    for entry in placements:
        cells = [f"{entry['family']}, {entry['class']}"]
        cells += [
            f"{entry['models'][w]} ({fleet_gpus(entry['models'][w], fleet)} GPUs)" for w in worlds
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(
    rows: Sequence[dict[str, Any]],
    placements: Sequence[dict[str, Any]],
    *,
    worlds: Sequence[str],
    kvshare: str,
    bound_gains: float,
    fleet: int,
    fleet_gpus: Any,
    plots: Sequence[Path] = (),
) -> str:
    """The suite: its summary per model class, one row per workload (worlds as columns),
    the page layouts compared, models per GPU, and links to ``plots``."""
    parts = [
        "Capacity at the SLO is the largest load scale (1 = the workload as generated) "
        f"at which a world meets it; `{kvshare}` is the default policy.",
        "",
        *_summary(rows, kvshare, bound_gains),
        "",
        *_workloads(rows, worlds, kvshare),
        "",
        *_pages(rows, kvshare),
        "",
        f"Models per GPU at the SLO (and the GPUs a fleet of {fleet} such models needs):",
        "",
        *_placements(placements, worlds, fleet, fleet_gpus),
    ]
    if plots:
        parts += ["", *(f"![{p.stem}]({p.as_posix()})" for p in plots)]
    return "\n".join(parts) + "\n"


def plot_families(
    rows: Sequence[dict[str, Any]], worlds: Sequence[str], directory: Path, relative_to: Path
) -> list[Path]:
    """One bar chart per family (capacity per world, a group per workload) as
    ``directory/capacity-<family>.png``; their paths relative to ``relative_to``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(mine)), 3.6))
        width = 0.8 / len(worlds)
        for index, world in enumerate(worlds):
            axes.bar(
                [i + index * width for i in range(len(mine))],
                [r["scales"][world] for r in mine],
                width,
                label=world,
            )
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))])
        axes.set_xticklabels([f"{r['class']} s{r['seed']}" for r in mine])
        axes.set_ylabel("capacity at the SLO (load scale)")
        axes.set_title(f"{family}: capacity at the latency SLO, one H200")
        axes.legend(fontsize="small", ncol=2)
        figure.tight_layout()
        path = directory / f"capacity-{family}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path.relative_to(relative_to))
    return written
