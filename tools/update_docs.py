"""Regenerate the generated blocks of the documentation (``make docs``); tests fail when
they drift.

Each block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in the page that
:data:`BLOCKS` names, and comes from the code that owns the facts, never from a second
hand-written copy.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvshare.api import env
from kvshare.deviceplugin.admin import metrics as node_metrics
from kvshare.runtime.engines import docs as engine_docs

ROOT = Path(__file__).resolve().parents[1]

#: block name -> (page, relative to the repository, and the function producing its content).
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "env-table": ("docs/configuration.md", env.markdown_table),
    "engine-support": ("docs/engines.md", engine_docs.support_table),
    "readme-engine-support": ("README.md", engine_docs.support_table),
    "engine-patches": ("docs/engines.md", engine_docs.patch_table),
    "node-metrics": ("docs/metrics.md", node_metrics.markdown_table),
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:start -->\n)(.*?)\n?(<!-- {name}:end -->)", re.S)


def block(page_text: str, name: str) -> str | None:
    """The current content of block ``name`` in ``page_text`` (None when it has none)."""
    match = _pattern(name).search(page_text)
    return None if match is None else match.group(2)


def render(page: str, text: str) -> str:
    """``text`` of ``page`` with each of its generated blocks replaced by current content."""
    for name, (owner, produce) in BLOCKS.items():
        if owner != page:
            continue
        pattern = _pattern(name)
        if not pattern.search(text):
            raise SystemExit(f"{page} has no {name} block")
        content = produce()
        text = pattern.sub(lambda m, c=content: m.group(1) + c + "\n" + m.group(3), text)
    return text


def pages() -> list[str]:
    """Every page that holds a generated block."""
    return sorted({page for page, _ in BLOCKS.values()})


def main() -> int:
    for page in pages():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        updated = render(page, text)
        if updated != text:
            path.write_text(updated, encoding="utf-8")
            print(f"{page} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
