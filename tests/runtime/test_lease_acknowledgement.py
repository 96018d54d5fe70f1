"""A lowered lease is always answered by a report, so the broker can hand the memory on."""

from __future__ import annotations

from kvshare.runtime.geometry import KVGeometry

from .conftest import PoolFactory
from .support import MIB, MovableLease


def test_a_lowered_lease_is_reported_even_when_nothing_had_to_be_released(
    make_pool: PoolFactory,
) -> None:
    lease = MovableLease(64 * MIB)
    pool = make_pool(
        KVGeometry(num_buffers=1, block_bytes=2 * MIB, num_blocks=64, page_size=2 * MIB),
        lease,
        reserve_pages=0,
        report_interval_s=3600.0,
    )
    pool.maintain()
    reports = len(lease.reports)
    pool.maintain()
    assert len(lease.reports) == reports  # nothing changed: nothing to say
    lease.set_limit(32 * MIB)  # the pool holds one page: nothing to give back
    pool.maintain()
    assert len(lease.reports) == reports + 1
    assert lease.reports[-1].mapped <= 32 * MIB
