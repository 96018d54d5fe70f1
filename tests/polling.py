"""Waiting, in tests, for something another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float = 30.0, what: str = "", *, interval: float = 0.02
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; fail the test
    after ``timeout`` seconds, saying ``what`` never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what or predicate}")
        time.sleep(interval)
