"""At the kernel's ``vm.max_map_count`` the pool says so clearly and stays consistent.

The real limit is reached: a child process maps single 4 KiB pages of two buffers that can
never merge, two mappings per page, until the kernel refuses (about 65,530 mappings, well
under two seconds). It runs in a child because a process at its map limit cannot even load
a library.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
_REACHABLE = 200_000  # beyond this, mapping up to the limit takes too long for a test


def child() -> None:
    """Map pages through the public pool API until the kernel refuses; print what happened."""
    from kvshare.runtime.backends.host import HostBackend
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.lease import StaticLease
    from kvshare.runtime.pool import Exhausted, KVPool

    limit = int(_MAX_MAP_COUNT.read_text())
    geometry = KVGeometry(
        num_buffers=2, block_bytes=4096, num_blocks=limit // 2 + 4096, page_size=4096
    )
    pool = KVPool(geometry, HostBackend(), StaticLease(2**40), reserve_pages=0, background=False)
    held: list[int] = []
    while True:
        ids = pool.alloc(1)
        if isinstance(ids, Exhausted):
            refusal = ids
            break
        held += ids
    pool.free(held[-2000:])  # give mappings back: the process can work again
    del held[-2000:]
    pool.maintain()
    again = pool.alloc(10)
    mapped = len(pool.mapped_pages())
    pool.close()
    print(
        json.dumps(
            {
                "reason": refusal.reason,
                "blocks": len(held),
                "mapped_after_free": mapped,
                "alloc_after_free": len(again) if again else 0,
            }
        )
    )


@pytest.mark.skipif(
    not _MAX_MAP_COUNT.exists() or int(_MAX_MAP_COUNT.read_text()) > _REACHABLE,
    reason="vm.max_map_count is too high to reach quickly here",
)
def test_the_map_count_limit_gives_a_clear_refusal_and_the_pool_recovers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from tests.runtime.test_map_limit import child; child()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reason"].startswith("map limit: the kernel refused another memory mapping")
    assert "vm.max_map_count is" in result["reason"]
    assert "sysctl -w vm.max_map_count=" in result["reason"]
    assert "KVSHARE_PAGE_SIZE" in result["reason"]
    limit = int(_MAX_MAP_COUNT.read_text())
    assert limit // 2 - 2000 < result["blocks"] + 2000 < limit // 2 + 1
    assert result["mapped_after_free"] == result["blocks"] + 11  # + page 0 + the 10 new ones
    assert result["alloc_after_free"] == 10
