"""Regenerate the README's generated blocks (``make docs``); tests fail when they drift.

Each block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` and comes from
the code that owns the facts, never from a second hand-written copy.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvshare.api import env
from kvshare.deviceplugin import metrics as node_metrics
from kvshare.runtime.engines import docs as engine_docs

README = Path(__file__).resolve().parents[1] / "README.md"

#: block name -> function producing its content.
BLOCKS: dict[str, Callable[[], str]] = {
    "env-table": env.markdown_table,
    "engine-support": engine_docs.support_table,
    "engine-patches": engine_docs.patch_table,
    "node-metrics": node_metrics.markdown_table,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    for name, produce in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no {name} block")
        content = produce()
        text = pattern.sub(lambda m, c=content: m.group(1) + c + "\n" + m.group(2), text)
    return text


def main() -> int:
    text = README.read_text(encoding="utf-8")
    updated = render(text)
    if updated != text:
        README.write_text(updated, encoding="utf-8")
        print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
