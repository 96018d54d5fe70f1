"""Helpers for the suites that run inside one engine environment."""

from __future__ import annotations

import pytest

from kvshare.runtime.engines.activation import engine_version
from kvshare.runtime.engines.registry import SupportedLine, find_line


def installed_line(engine: str) -> SupportedLine:
    """The support line of the engine installed in this environment."""
    return find_line(engine, engine_version(engine))


def mark_engines(items: list[pytest.Item]) -> None:
    """Mark every collected test ``engines``: it needs the real engine package."""
    for item in items:
        item.add_marker(pytest.mark.engines)
