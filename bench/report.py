"""BENCHMARKS.md: one table per benchmark with target, measured value, machine and date."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from harness import Result

_HEADER = """# Benchmarks

Written by `make bench` (`python bench/run.py --all --write BENCHMARKS.md`); do not edit the
tables by hand (`python bench/run.py NAME --write BENCHMARKS.md` re-runs one and replaces its
table). Each benchmark measures its baseline in the same run as the thing compared with it.
Reproduce one with the command under its table; `--json` prints the fields as JSON.
"""

_GPU_MARKER = "<!-- gpu-check results below are kept across `make bench` runs -->"
_NO_GPU_RUN = """## GPU check

Not run yet: `make gpu-check` on a machine with an NVIDIA GPU and PyTorch records its
results here (`make gpu-check --dry-run` exercises it without a GPU).
"""


def _table(result: Result, machine: str, date: str, command: str) -> str:
    lines = [f"## {result.name}", ""]
    if result.tables:
        lines += [result.tables.rstrip("\n"), ""]
    lines += ["| field | measured | target | met |", "|---|---|---|---|"]
    for key, value in result.fields.items():
        if result.detail_prefixes and key.startswith(result.detail_prefixes):
            continue
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        target = result.verdict(key)
        if target is None:
            lines.append(f"| `{key}` | {shown} | | |")
        else:
            met = "yes" if target[1] else "**no**"
            lines.append(f"| `{key}` | {shown} | {target[0]} | {met} |")
    lines += ["", f"Machine: {machine}. Date: {date}.", ""]
    lines += [f"Command: `{command.replace('--all', result.name)}`", ""]
    if result.notes:
        lines += [result.notes, ""]
    return "\n".join(lines)


def _coverage(names: Sequence[str], crashed: Sequence[str], missing: Sequence[str]) -> str:
    line = "Run: " + ", ".join(f"`{name}`" for name in names) + "."
    if crashed:
        line += " Failed with an error (see its table): "
        line += ", ".join(f"`{name}`" for name in crashed) + "."
    if missing:
        line += " Not present in this checkout, so not run: "
        line += ", ".join(f"`{name}`" for name in missing) + "."
    return line + "\n"


def _tables(text: str) -> dict[str, str]:
    """The benchmark tables of a report, by benchmark name (the GPU section is not one)."""
    body = text[: text.index(_GPU_MARKER)] if _GPU_MARKER in text else text
    chunks = re.split(r"^(?=## )", body, flags=re.MULTILINE)[1:]
    return {chunk.split("\n", 1)[0][3:].strip(): chunk.rstrip("\n") + "\n" for chunk in chunks}


def write_report(
    path: Path,
    results: list[Result],
    *,
    machine: str,
    date: str,
    command: str,
    missing: list[str] | None = None,
    keep_others: bool = False,
    order: Sequence[str] = (),
) -> None:
    """Rewrite ``path``: which benchmarks ran, their tables, then any GPU-check section.

    With ``keep_others`` the tables of benchmarks not in ``results`` stay as they were (a
    benchmark re-run on its own replaces only its table); tables follow ``order``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = (
        text[text.index(_GPU_MARKER) :]
        if _GPU_MARKER in text
        else f"{_GPU_MARKER}\n\n{_NO_GPU_RUN}"
    )
    tables = _tables(text) if keep_others else {}
    tables.update({r.name: _table(r, machine, date, command) for r in results})
    ranked = sorted(tables, key=lambda name: order.index(name) if name in order else len(order))
    crashed = [r.name for r in results if r.crashed]
    head = _HEADER + "\n" + _coverage(ranked, crashed, missing or []) + "\n"
    body = "\n".join(tables[name] for name in ranked)
    path.write_text(head + body + "\n" + kept, encoding="utf-8")


def write_gpu_section(path: Path, section: str) -> None:
    """Replace the GPU-check section of ``path`` (kept across ``make bench`` runs)."""
    text = path.read_text(encoding="utf-8") if path.exists() else _HEADER
    if _GPU_MARKER in text:
        text = text[: text.index(_GPU_MARKER)]
    path.write_text(text.rstrip("\n") + "\n\n" + _GPU_MARKER + "\n\n" + section, encoding="utf-8")
