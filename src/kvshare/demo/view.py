"""The demo's live view: a table redrawn in place on a terminal, plain lines otherwise.

On a TTY the view rewrites its last frame (ANSI cursor-up and clear), so the table stays
put while the numbers move: progress, and for each model in each run the requests served,
the queue, and the KV memory it holds (its lease) as a bar on the scale of the GPU. When the
output is a pipe or a file it prints one line per run every few seconds instead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from kvshare.demo.stats import MODES, Mode, Sample

__all__ = ["LiveView", "format_size", "render_frame", "render_line", "unit_of"]

_BAR = 16
_TITLES: dict[Mode, str] = {"static": "static partitions", "elastic": "elastic (kvshare)"}


def unit_of(gpu_bytes: float) -> tuple[int, str]:
    """GiB for a GPU of a GiB or more, MiB below (the real engines' demo GPU)."""
    return (2**30, "GiB") if gpu_bytes >= 2**30 else (2**20, "MiB")


def format_size(size: float, gpu_bytes: float) -> str:
    """Bytes with two decimals, in the unit of a GPU of ``gpu_bytes``."""
    unit, name = unit_of(gpu_bytes)
    return f"{size / unit:.2f} {name}"


def _bar(size: float, scale: float) -> str:
    filled = 0 if scale <= 0 else min(_BAR, round(_BAR * size / scale))
    return "█" * filled + "·" * (_BAR - filled)


def _cells(sample: Sample | None, scale: float) -> str:
    if sample is None:
        return f"{'-':>6} {'-':>6}  {'·' * _BAR} {'starting':>9}"
    return (
        f"{sample.served:>6} {sample.waiting:>6}  {_bar(sample.lease, scale)} "
        f"{format_size(sample.lease, scale):>9}"
    )


def render_frame(
    elapsed_s: float,
    duration_s: float,
    *,
    gpu_bytes: int,
    models: int,
    latest: Mapping[tuple[Mode, int], Sample],
    footer: Sequence[str] = (),
) -> list[str]:
    """The lines of one frame of the TTY view."""
    done = min(1.0, max(0.0, elapsed_s / duration_s)) if duration_s > 0 else 1.0
    filled = round(30 * done)
    lines = [
        f"kvshare demo  {'━' * filled}{'─' * (30 - filled)}  {elapsed_s:5.1f} s of "
        f"{duration_s:.0f} s   each run: {models} models on one "
        f"{format_size(gpu_bytes, gpu_bytes)} GPU",
        "",
        (f"{'':<9}" + "".join(f"{_TITLES[m]:<44}" for m in MODES)).rstrip(),
        (
            f"{'model':<9}" + f"{'served':>6} {'queued':>6}  {'KV memory (lease)':<26}   " * 2
        ).rstrip(),
    ]
    for model in range(models):
        row = f"model-{model:<3}"
        for mode in MODES:
            row += _cells(latest.get((mode, model)), gpu_bytes) + "   "
        lines.append(row.rstrip())
    total = f"{'total':<9}"
    for mode in MODES:
        samples = [latest[(mode, m)] for m in range(models) if (mode, m) in latest]
        if samples:
            served = sum(s.served for s in samples)
            queued = sum(s.waiting for s in samples)
            held = sum(s.lease for s in samples)
            size = format_size(held, gpu_bytes)
            total += f"{served:>6} {queued:>6}  {_bar(held, gpu_bytes)} {size:>9}   "
        else:
            total += _cells(None, gpu_bytes) + "   "
    lines += [total.rstrip(), "", *footer]
    return lines


def render_line(
    elapsed_s: float, models: int, latest: Mapping[tuple[Mode, int], Sample], gpu_bytes: int
) -> str:
    """One progress line for a non-interactive output."""
    unit, name = unit_of(gpu_bytes)
    parts = []
    for mode in MODES:
        samples = [latest[(mode, m)] for m in range(models) if (mode, m) in latest]
        if not samples:
            parts.append(f"{mode}: starting")
            continue
        held = " ".join(f"{s.lease / unit:.2f}" for s in samples)
        parts.append(
            f"{mode}: served {sum(s.served for s in samples)}, queued "
            f"{sum(s.waiting for s in samples)}, KV {name} per model {held}"
        )
    return f"[{elapsed_s:5.1f} s] " + " | ".join(parts)


class LiveView:
    """Draws the run's progress on ``stream``: in place on a TTY, plain lines otherwise."""

    def __init__(
        self,
        stream: TextIO,
        *,
        duration_s: float,
        gpu_bytes: int,
        models: int,
        interactive: bool | None = None,
        plain_every_s: float = 5.0,
    ) -> None:
        self._stream = stream
        self._duration_s = duration_s
        self._gpu_bytes = gpu_bytes
        self._models = models
        self._interactive = stream.isatty() if interactive is None else interactive
        self._plain_every_s = plain_every_s
        self._drawn = 0
        self._last_plain = -float("inf")

    @property
    def interactive(self) -> bool:
        return self._interactive

    def update(
        self,
        elapsed_s: float,
        latest: Mapping[tuple[Mode, int], Sample],
        footer: Sequence[str] = (),
    ) -> None:
        """Show the state at ``elapsed_s``."""
        if self._interactive:
            lines = render_frame(
                elapsed_s,
                self._duration_s,
                gpu_bytes=self._gpu_bytes,
                models=self._models,
                latest=latest,
                footer=footer,
            )
            rewind = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
            self._stream.write(rewind + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        else:
            now = time.monotonic()
            if now - self._last_plain < self._plain_every_s:
                return
            self._last_plain = now
            self._stream.write(render_line(elapsed_s, self._models, latest, self._gpu_bytes) + "\n")
        self._stream.flush()
