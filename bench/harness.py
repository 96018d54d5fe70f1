"""What every benchmark returns, and how results are printed and recorded.

A benchmark is a module ``bench/<name>.py`` with a function ``run(quick: bool) -> Result``.
``Result.fields`` holds the measured values under the names the issues give; ``targets``
say which of them must stay above or below what. Baselines are measured in the same run
as the thing they are compared with, so ratios stay meaningful on shared machines.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Target:
    """``field`` must be ``op`` ``value`` (e.g. ``full_plan_s <= 2.0``)."""

    field: str
    op: Literal["<=", ">="]
    value: float

    def met_by(self, measured: float) -> bool:
        return measured <= self.value if self.op == "<=" else measured >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass
class Result:
    """One benchmark's outcome."""

    name: str
    fields: dict[str, float | int | str]
    targets: list[Target] = field(default_factory=list)
    notes: str = ""
    tables: str = ""
    """Markdown a person reads first (a benchmark of many measurements summarises them
    here); shown above the fields in the report."""
    detail_prefixes: tuple[str, ...] = ()
    """Fields whose names start with one of these are in the JSON only: ``tables`` shows
    them to a person."""
    crashed: bool = False
    """The benchmark raised instead of measuring; ``fields`` holds only the error."""

    def failed_targets(self) -> list[Target]:
        return [t for t in self.targets if not t.met_by(float(self.fields[t.field]))]

    def verdict(self, key: str) -> tuple[str, bool] | None:
        """The targets of field ``key`` in words (a range reads ``>= a and <= b``) and
        whether the measured value meets every one; None when it has no target."""
        targets = [t for t in self.targets if t.field == key]
        if not targets:
            return None
        measured = float(self.fields[key])
        return " and ".join(map(str, targets)), all(t.met_by(measured) for t in targets)


def machine() -> str:
    """One line describing this machine, for the report."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def percentile(samples: list[float], pct: float) -> float:
    """The ``pct``-th percentile (0-100) by nearest rank."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
