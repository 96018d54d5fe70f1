"""A pool's side of its lease conversation: what it asks, when it says it again, and
which reports acknowledge a reclaim."""

from __future__ import annotations

import itertools

from kvshare.api.wire import Reclaim
from kvshare.deviceplugin.broker.policy import Entitlement
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage
from kvshare.runtime.lease_conversation import REFRESH_S, LeaseConversation
from kvshare.runtime.pool import KVPool

PAGE = 2 * 2**20
CHUNK = 8 * PAGE


def conversation() -> LeaseConversation:
    return LeaseConversation(
        chunk_bytes=CHUNK,
        page_size=PAGE,
        ceiling=None,
        report_interval_s=0.05,
        slow_start_window_s=1.0,
    )


def test_an_unmet_ask_is_said_again_after_a_while_and_a_met_one_is_not() -> None:
    talk = conversation()
    assert talk.want(3 * CHUNK, 0.0)
    first = talk.next_want()
    assert first is not None and first.total == 3 * CHUNK
    # Asking the same again at once says nothing new.
    assert not talk.want(3 * CHUNK, 0.1) and talk.next_want() is None
    # Still short a while later: the same ask again, so the broker knows it still stands.
    assert talk.want(3 * CHUNK, REFRESH_S + 0.1)
    again = talk.next_want()
    assert again is not None and again.total == 3 * CHUNK and again.seq > first.seq
    # Granted: asking for no more than the lease says nothing.
    talk.granted(3 * CHUNK, 1.0)
    assert not talk.want(3 * CHUNK, 5.0) and talk.next_want() is None


def test_only_a_report_made_with_a_reclaim_in_force_acknowledges_it() -> None:
    talk = conversation()
    talk.granted(4 * CHUNK, 0.0)
    talk.report(PoolUsage(mapped=4 * CHUNK, used=4 * CHUNK, cached=0, reserved=0))
    talk.next_report(0.0)
    talk.reclaimed(Reclaim(seq=7, limit=2 * CHUNK, deadline_s=10.0, reason="contention"))
    talk.report(PoolUsage(mapped=3 * CHUNK, used=3 * CHUNK, cached=0, reserved=0))
    partial, _ = talk.next_report(0.01)  # at once, although within the report interval
    assert partial is not None and partial.ack == 7
    talk.report(PoolUsage(mapped=2 * CHUNK, used=2 * CHUNK, cached=0, reserved=0))
    done, _ = talk.next_report(0.02)
    assert done is not None and done.ack == 7
    talk.report(PoolUsage(mapped=2 * CHUNK, used=CHUNK, cached=0, reserved=0))
    later, wait = talk.next_report(0.03)
    assert later is None and wait > 0  # the reclaim is complete: back to the interval


def test_a_pool_still_short_says_so_again_before_the_broker_lets_its_ask_lapse() -> None:
    """The broker counts an ask only for ``fresh_s`` after it last heard it; a pool that
    stays short (its engine failing an allocation every step) must say it again well
    within that, through the pool's retry and the conversation's rate limit together, or
    the broker would call its reclaims off while it still waits."""
    geometry = KVGeometry(num_buffers=4, block_bytes=4096, num_blocks=64, page_size=64 * 1024)
    page = geometry.page_bytes
    talk = LeaseConversation(
        chunk_bytes=page,
        page_size=page,
        ceiling=None,
        report_interval_s=0.05,
        slow_start_window_s=1.0,
    )
    now = [0.0]
    said: list[float] = []

    class Conversing(LeaseSource):
        """The broker client's part, without its socket: what it would send, and when."""

        def attach(self, holder: LeaseHolder) -> None:
            talk.granted(2 * page, now[0])

        def limit(self) -> int:
            return talk.limit

        def want(self, total_bytes: int) -> None:
            if talk.want(total_bytes, now[0]) and talk.next_want() is not None:
                said.append(now[0])

        def report(self, usage: PoolUsage) -> None:
            talk.report(usage)

    pool = KVPool(
        geometry,
        HostBackend(),
        Conversing(),
        background=False,
        reserve_pages=0,
        clock=lambda: now[0],
    )
    try:
        while pool.alloc(1):
            pass
        step_s = 0.05
        while now[0] < 5.0:  # a scheduler step every 50 ms, each short of a block
            now[0] += step_s
            assert not pool.alloc(1)
        gaps = [later - earlier for earlier, later in itertools.pairwise(said)]
        assert len(said) > 5
        assert max(gaps) <= Entitlement().fresh_s / 2 + step_s + 1e-9, gaps
    finally:
        pool.close()
