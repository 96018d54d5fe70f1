"""The documentation holds together: every relative link (and its #anchor) resolves, every
generated table is what `make docs` would write, and the README stays a first page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from tools import update_docs

ROOT = Path(__file__).resolve().parents[1]
#: ``[text](target)``, the target up to whitespace or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_pages() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives the headings of ``page``."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_catches_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading) [gone](missing.md) [no heading](there.md#nope)\n"
        "```\n[inside a fence](ignored.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "there.md#nope: there.md has no heading #nope",
    ]


@pytest.mark.parametrize("name", sorted(update_docs.BLOCKS))
def test_every_generated_table_is_current(name: str) -> None:
    page, produce = update_docs.BLOCKS[name]
    current = update_docs.block((ROOT / page).read_text(encoding="utf-8"), name)
    assert current is not None, f"{page} lacks the {name} markers"
    assert current == produce(), "run `make docs` to regenerate the table"


def test_the_readme_is_a_first_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, "references belong in docs/"
