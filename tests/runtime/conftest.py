"""Fixtures for the runtime tests: pools on the real host backend, always closed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseSource, StaticLease
from kvshare.runtime.pool import KVPool

PoolFactory = Callable[..., KVPool]


@pytest.fixture
def make_pool() -> Iterator[PoolFactory]:
    """``make_pool(geometry, lease=None, **options)`` -> a pool on a fresh host backend."""
    pools: list[KVPool] = []

    def make(geometry: KVGeometry, lease: LeaseSource | None = None, **options: Any) -> KVPool:
        options.setdefault("background", False)
        pool = KVPool(geometry, HostBackend(), lease or StaticLease(2**30), **options)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
