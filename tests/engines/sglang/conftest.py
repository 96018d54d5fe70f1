"""Fixtures of the SGLang suite (runs inside one SGLang environment, see ../conftest.py)."""

from __future__ import annotations

import pytest

from kvshare.api.engines import SupportedLine
from kvshare.runtime.engines.patching import Target
from tests.engines.suite import installed_line, mark_engines


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_engines(items)


@pytest.fixture(scope="session")
def engine() -> str:
    return "sglang"


@pytest.fixture(scope="session")
def line() -> SupportedLine:
    return installed_line("sglang")


@pytest.fixture
def moved_target() -> Target:
    return Target(
        "sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.alloc", ("self", "count")
    )
