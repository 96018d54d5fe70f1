"""Benchmark ``blocks``: the pool's allocation hot path, and how rarely it waits for a page.

``alloc_free_blocks_per_s``: one thread allocates a batch of 16 blocks and frees it again,
over and over, with the pages already mapped (some partly used, as in a running engine);
blocks handed out per second. ``waits_fraction``: a steady growth workload with the
reserve thread on — each engine step allocates eight batches of 16 blocks (one 2 MiB page
worth) and frees four older ones, then sleeps 2 ms as if running the model — and the share
of allocations that had to create a page on the spot because the reserve was empty.
"""

from __future__ import annotations

import time

from harness import Result, Target
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

PAGE = 2 * 2**20
BATCH = 16


def hot_path_blocks_per_s(pairs: int) -> float:
    geometry = KVGeometry(num_buffers=1, block_bytes=16384, num_blocks=2**16, page_size=PAGE)
    pool = KVPool(geometry, HostBackend(), StaticLease(2**30), reserve_pages=4, background=False)
    try:
        pool.maintain()  # map the reserve
        batches = [pool.alloc(BATCH) for _ in range(40)]
        for batch in batches[::2]:  # leave partly used pages behind
            pool.free(batch or [])
        alloc, free = pool.alloc, pool.free
        waits_before = pool.snapshot().waits
        start = time.perf_counter()
        for _ in range(pairs):
            ids = alloc(BATCH)
            free(ids)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        assert pool.snapshot().waits == waits_before, "the measured loop created pages"
    finally:
        pool.close()
    return pairs * BATCH / elapsed


def growth_waits(steps: int) -> tuple[float, int]:
    geometry = KVGeometry(
        num_buffers=1, block_bytes=16384, num_blocks=(steps + 8) * 64, page_size=PAGE
    )
    pool = KVPool(geometry, HostBackend(), StaticLease(2**40), reserve_pages=4, background=True)
    try:
        time.sleep(0.05)  # the reserve thread fills the reserve once at start
        live: list[list[int]] = []
        for _ in range(steps):
            for _ in range(8):
                ids = pool.alloc(BATCH)
                assert ids, ids
                live.append(ids)
            for _ in range(4):
                pool.free(live.pop(0))
            time.sleep(0.002)
        snapshot = pool.snapshot()
    finally:
        pool.close()
    return snapshot.waits / snapshot.allocations, snapshot.allocations


def run(quick: bool) -> Result:
    pairs, steps = (50_000, 60) if quick else (300_000, 200)
    blocks_per_s = hot_path_blocks_per_s(pairs)
    waits_fraction, allocations = growth_waits(steps)
    return Result(
        name="blocks",
        fields={
            "batch": BATCH,
            "alloc_free_blocks_per_s": round(blocks_per_s),
            "growth_allocations": allocations,
            "waits_fraction": round(waits_fraction, 4),
        },
        targets=[
            Target("alloc_free_blocks_per_s", ">=", 1_000_000),
            Target("waits_fraction", "<=", 0.01),
        ],
        notes="Host backend, 2 MiB pages, 16 KiB blocks, one allocating thread.",
    )
