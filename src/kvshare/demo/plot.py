"""The demo's picture: KV memory per model over time, static against elastic, and delays;
beside them, when the run measured it, capacity at the latency SLO in the GPU twin.

Three panels share the time axis: the KV memory each model holds (its lease: what it
may map and nobody else may use) under static partitions, stacked, the same under
elastic sharing with what the pools actually mapped as a line, and every request's queueing delay
against its arrival time in both runs. Each model's busy windows are shaded in its
colour, so it is visible who needed memory when, and who got it. The capacity panel
draws each world's attainment curve (the least model's share of requests within the SLO
against the load scale), the SLO's attainment line, and each world's capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvshare.demo.stats import MODES, Comparison, ServerResult
from kvshare.demo.trace import Phase
from kvshare.demo.view import unit_of

if TYPE_CHECKING:
    from kvshare.demo.capacity import CapacityReport

__all__ = ["write_plot"]


def write_plot(
    path: Path,
    results: Sequence[ServerResult],
    comparison: Comparison,
    phases: Sequence[Phase],
    *,
    gpu_bytes: int,
    duration_s: float,
    capacity: CapacityReport | None = None,
) -> Path:
    """Draw the comparison into a PNG at ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.model for r in results})
    colours = [plt.get_cmap("tab10")(i % 10) for i in range(max(models, default=0) + 1)]
    unit, unit_name = unit_of(gpu_bytes)
    fig = plt.figure(figsize=(17 if capacity else 11, 9))
    grid = fig.add_gridspec(3, 2 if capacity else 1, width_ratios=[11, 6] if capacity else [1])
    first = fig.add_subplot(grid[0, 0])
    axes = [first, *(fig.add_subplot(grid[i, 0], sharex=first) for i in (1, 2))]
    if capacity is not None:
        _capacity_panel(fig.add_subplot(grid[:, 1]), capacity)
    titles = {
        "static": "static partitions: KV memory per model (equal shares; line: mapped)",
        "elastic": "elastic (kvshare broker): KV memory leased per model (line: mapped)",
    }
    for ax, mode in zip(axes[:2], MODES, strict=True):
        mine = sorted((r for r in results if r.mode == mode), key=lambda r: r.model)
        _shade_busy(ax, phases, colours)
        if mine and mine[0].samples:
            times = [s.t for s in mine[0].samples]
            stacks = [_on(r, times, "lease", unit) for r in mine]
            ax.stackplot(
                times,
                stacks,
                labels=[f"model-{r.model}" for r in mine],
                colors=[colours[r.model] for r in mine],
                alpha=0.85,
            )
            held = [_on(r, times, "held", unit) for r in mine]
            mapped = [sum(v) for v in zip(*held, strict=True)]
            ax.plot(times, mapped, color="black", linewidth=1, label="mapped (all models)")
        ax.axhline(gpu_bytes / unit, color="black", linestyle="--", linewidth=1)
        ax.text(0, gpu_bytes / unit, " GPU", va="bottom", fontsize=8)
        ax.set_ylim(0, gpu_bytes / unit * 1.12)
        ax.set_ylabel(unit_name)
        ax.set_title(titles[mode], fontsize=10, loc="left")
        ax.legend(loc="upper right", fontsize=8, ncol=len(mine) + 1)

    ax = axes[2]
    _shade_busy(ax, phases, colours)
    for mode, marker, colour in (("static", "x", "tab:red"), ("elastic", ".", "tab:blue")):
        arrivals = [a for r in results if r.mode == mode for a in r.wait_arrivals_s]
        waits = [w for r in results if r.mode == mode for w in r.waits_s]
        summary = comparison.static if mode == "static" else comparison.elastic
        ax.scatter(
            arrivals,
            waits,
            s=10,
            marker=marker,
            color=colour,
            alpha=0.6,
            label=f"{mode}: p50 {summary.p50_wait_s:.2f} s, p95 {summary.p95_wait_s:.2f} s",
        )
    ax.set_ylabel("queueing delay (s)")
    ax.set_xlabel("trace time (s); shaded: each model's busy window")
    ax.set_title("queueing delay of each request, by arrival time", fontsize=10, loc="left")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_xlim(0, duration_s)

    title = f"kvshare demo: {len(models)} models on one {gpu_bytes / unit:.1f} {unit_name} GPU"
    if capacity is None:
        title += f" — served static {comparison.static.served}, elastic "
        title += f"{comparison.elastic.served} (x{comparison.ratio:.2f})"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _on(result: ServerResult, times: Sequence[float], what: str, unit: int) -> list[float]:
    """Sample field ``what`` in ``unit`` bytes at each of ``times`` (latest sample at or
    before it)."""
    values = []
    index = 0
    samples = result.samples
    for t in times:
        while index + 1 < len(samples) and samples[index + 1].t <= t:
            index += 1
        size = getattr(samples[index], what) if samples and samples[index].t <= t else 0
        values.append(size / unit)
    return values


def _shade_busy(ax: object, phases: Sequence[Phase], colours: Sequence[object]) -> None:
    for phase in phases:
        if phase.busy:
            ax.axvspan(  # type: ignore[attr-defined]
                phase.start_s, phase.end_s, color=colours[phase.model], alpha=0.08, linewidth=0
            )


def _capacity_panel(ax: Any, report: CapacityReport) -> None:
    """Attainment against load scale per world, with each world's capacity marked."""
    for index, (world, curve) in enumerate(report.curves.items()):
        colour = f"C{index}"
        scales = [s for s, _ in curve]
        ax.plot(scales, [a * 100 for _, a in curve], marker="o", color=colour, label=world)
        ax.axvline(report.capacity[world], color=colour, linestyle=":", linewidth=1)
    ax.axhline(95, color="black", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], 95, " SLO: every model >= 95 %", va="bottom", fontsize=8)
    ax.set_xlabel("load scale (dotted: each world's capacity at the SLO)")
    ax.set_ylabel("least model's requests within the SLO (%)")
    ax.set_title(
        f"capacity at the SLO, GPU twin of one {report.gpu}:\n{report.workload}",
        fontsize=10,
        loc="left",
    )
    ax.legend(loc="lower left", fontsize=8)
