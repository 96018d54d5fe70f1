"""The tables of engine support in docs/engines.md, from the support table and patch sets.

Importing a patch module imports neither torch nor the engine (targets are imported when
patches are applied), so ``make docs`` runs anywhere.
"""

from __future__ import annotations

from kvshare.api.engines import SUPPORTED, markdown_table
from kvshare.runtime.engines.registry import patch_set

__all__ = ["patch_table", "support_table"]


def support_table() -> str:
    """Supported engine lines: versions, tested release, TP ownership, patch module."""
    return markdown_table()


def patch_table() -> str:
    """Every patch target, what kvshare changes there, and the lines that patch it."""
    rows = ["| engine | target | change | lines |", "|---|---|---|---|"]
    seen: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for line in SUPPORTED:
        for patch in patch_set(line).patches:
            key = (line.engine, str(patch.target))
            why, lines = seen.setdefault(key, (patch.why, []))
            lines.append(line.label)
    for (engine, target), (why, lines) in seen.items():
        rows.append(f"| {engine} | `{target}` | {why} | {', '.join(lines)} |")
    return "\n".join(rows)
