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


def test_a_lease_lowered_in_a_steady_scope_waits_for_its_end_and_is_acknowledged_then(
    make_pool: PoolFactory,
) -> None:
    lease = MovableLease(8 * MIB)
    pool = make_pool(
        KVGeometry(num_buffers=1, block_bytes=MIB, num_blocks=16, page_size=2 * MIB),
        lease,
        reserve_pages=0,
        report_interval_s=3600.0,
    )
    counted = pool.available()  # 4 pages of 2 blocks, less the null block
    assert counted == 7
    with pool.steady_lease():
        with pool.steady_lease():  # scopes nest (and overlap across threads)
            lease.set_limit(2 * MIB)  # a reclaim lands between counting and taking
            pool.maintain()
            assert lease.reports[-1].limit == 8 * MIB  # the old lease: no acknowledgement
            lease.set_limit(4 * MIB)  # the latest word wins, still lower: still waits
            ids = pool.alloc(counted)
            assert isinstance(ids, list) and len(ids) == counted  # what was counted is there
        assert pool.snapshot().lease == 8 * MIB  # an outer scope is still open
        lease.set_limit(12 * MIB)  # a raised lease applies at once, dropping the lower one
        assert pool.snapshot().lease == 12 * MIB
        lease.set_limit(4 * MIB)
    snap = pool.snapshot()
    assert snap.lease == 4 * MIB and not pool.alloc(1)  # over the lease now: no growth
    pool.free(ids)
    pool.maintain()
    assert lease.reports[-1].limit == 4 * MIB and lease.reports[-1].mapped <= 4 * MIB
