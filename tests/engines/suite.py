"""Helpers for the suites that run inside one engine environment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tools import runtime_bundle

from kvshare.api import env
from kvshare.api.engines import SupportedLine, find_line
from kvshare.runtime.engines import pools
from kvshare.runtime.engines.activation import engine_version
from kvshare.runtime.engines.pools import Role
from kvshare.runtime.lease import LeaseSource
from tests.runtime.support import MovableLease


def installed_line(engine: str) -> SupportedLine:
    """The support line of the engine installed in this environment."""
    return find_line(engine, engine_version(engine))


def mark_engines(items: list[pytest.Item]) -> None:
    """Mark every collected test ``engines``: it needs the real engine package."""
    for item in items:
        item.add_marker(pytest.mark.engines)


def movable_lease(role: Role) -> LeaseSource:
    """A lease the test moves as the broker would (stand-in for the node agent's broker):
    ``KVSHARE_KV_LIMIT`` at first, lowered by ``set_limit``."""
    return MovableLease(env.KV_LIMIT.require())


def eventually(
    condition: Callable[[], bool], step: Callable[[], object], timeout_s: float = 60.0
) -> bool:
    """Run ``step`` until ``condition`` holds (a lease change travels between threads and
    processes); ``False`` if it did not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        step()
        time.sleep(0.01)
    return True


def standalone_host_pools(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, page_size: int, lease: int
) -> None:
    """Pools on the host backend with a lease the test moves, no node agent, no reserve."""
    monkeypatch.setattr(pools, "lease_for", movable_lease)
    for variable, value in (
        (env.BACKEND, "host"),
        (env.PAGE_SIZE, str(page_size)),
        (env.KV_LIMIT, str(lease)),
        (env.RESERVE_PAGES, "0"),
        (env.BROKER_SOCKET, str(tmp_path / "no-broker.sock")),
    ):
        monkeypatch.setenv(variable.name, value)


def injected_bundle(directory: Path) -> Path:
    """The runtime bundle as the image builds it (``tools/runtime_bundle.py``), without the
    vendored cuda-python (the host backend needs none): what the operator injects."""
    runtime_bundle.build(directory, directory.parent / "wheels", [])
    return directory
