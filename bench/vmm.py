"""Benchmark ``vmm``: what the pool's page map path costs over the bare system calls.

Host backend, one 2 MiB page created once. ``raw_map_unmap_us``: the bare pair — ``mmap``
of the memfd page ``MAP_FIXED|MAP_SHARED`` into a ``PROT_NONE`` reservation, then the
``PROT_NONE`` remap that unmaps it — through libc directly. ``pool_map_unmap_us``: the
same page mapped and unmapped through the pool's own path (``PageSpace.map``/``unmap`` with
its bounds checks and bookkeeping, and the backend's checks). Both are measured in
alternating rounds of the same run; each value is the median per-pair time of the rounds.
``create_release_us`` (no target): creating and releasing the page's physical memory
(``fallocate`` and ``PUNCH_HOLE`` of 2 MiB), which the reserve thread keeps off the
allocation path.
"""

from __future__ import annotations

import os
import statistics
import time

from harness import Result, Target
from kvshare.runtime.backends import libc
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pages import PageSpace

PAGE = 2 * 2**20


def _per_pair_us(pair: object, repeats: int) -> float:
    assert callable(pair)
    start = time.perf_counter()
    for _ in range(repeats):
        pair()
    return (time.perf_counter() - start) / repeats * 1e6


def run(quick: bool) -> Result:
    rounds, repeats = (10, 200) if quick else (30, 1000)

    fd = os.memfd_create("kvshare-bench-raw", os.MFD_CLOEXEC)
    os.ftruncate(fd, PAGE)
    libc.fallocate(fd, 0, 0, PAGE)
    reservation = libc.mmap(
        0, 4 * PAGE, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
    )
    raw_address = reservation + PAGE

    def raw_pair() -> None:
        libc.map_shared_fixed(raw_address, PAGE, fd, 0)
        libc.protect_none_fixed(raw_address, PAGE)

    backend = HostBackend()
    space = PageSpace(
        KVGeometry(num_buffers=1, block_bytes=PAGE, num_blocks=4, page_size=PAGE), backend
    )
    space.create([1])

    def pool_pair() -> None:
        space.map([1])
        space.unmap([1])

    def create_release() -> None:
        space.create([2])
        space.release([2])

    raw: list[float] = []
    pool: list[float] = []
    lifecycle: list[float] = []
    try:
        for _ in range(rounds):
            raw.append(_per_pair_us(raw_pair, repeats))
            pool.append(_per_pair_us(pool_pair, repeats))
            lifecycle.append(_per_pair_us(create_release, max(1, repeats // 20)))
    finally:
        space.release([1])
        space.close()
        backend.close()
        libc.munmap(reservation, 4 * PAGE)
        os.close(fd)

    raw_us = statistics.median(raw)
    pool_us = statistics.median(pool)
    return Result(
        name="vmm",
        fields={
            "page_bytes": PAGE,
            "raw_map_unmap_us": round(raw_us, 3),
            "pool_map_unmap_us": round(pool_us, 3),
            "ratio": round(pool_us / raw_us, 3),
            "create_release_us": round(statistics.median(lifecycle), 1),
        },
        targets=[Target("ratio", "<=", 2.0)],
        notes=(
            "Host backend (memfd + mmap). The cuda backend's map/unmap latency needs a GPU "
            "machine (tests/gpu)."
        ),
    )
