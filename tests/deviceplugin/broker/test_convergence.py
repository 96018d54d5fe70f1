"""Reclaims that converge: the real books and policy, on a simulated clock, with pools
that ask as a vLLM server's pool does under kvshare.

A vLLM server keeps every block it frees as prefix cache, so its lease fills with cache.
Its pool keeps a few ready pages ahead of the engine, but asks the broker for them only
beyond what its own cache covers (the engine reuses cached blocks when the pool has none
fresh: ``tests/runtime/test_pool.py``), and asks for more whenever requests wait. Under
steady load leases settle: once they have, no reclaim is made at all. A reclaim whose
pool stops asking before the memory comes back is called off and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvshare.api.wire import Hello, Lease, Reclaim, Report
from kvshare.deviceplugin.broker.books import Books, BrokerEvents, Send
from kvshare.deviceplugin.broker.policy import POLICIES, policy_named
from kvshare.deviceplugin.inventory import GpuInfo

MIB = 2**20
GIB = 2**30
PAGE = MIB
CHUNK = 4 * MIB
RESERVE = 4 * MIB
#: 32 MiB lent, as in the co-located serving tests.
GPU = GpuInfo(uuid="GPU-converge-0", index=0, name="test", total_bytes=GIB)
HEADROOM = GIB - 32 * MIB
DEADLINE_S = 10.0
STEP_S = 0.05


def up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass
class CachingServer:
    """A vLLM-like pool whose requests want ``active`` bytes of blocks. What it holds
    beyond the blocks in use is prefix cache (a serving engine fills its lease with it);
    it asks for ``RESERVE`` ready ahead beyond its cache, and for its requests' blocks
    when they do not fit, again every 0.5 s while its engine is busy and every 5 s while
    it is idle (its maintenance timer). On a reclaim it evicts cache at once; its blocks
    in use go only as their requests finish (``release_after_s``)."""

    id: int
    active: int
    lease: int = 0
    in_use: int = 0
    held: int = 0
    next_ask: float = 0.0
    asks: int = 0
    pending: Reclaim | None = None
    pending_since: float = 0.0
    release_after_s: float = 0.0
    leases: list[int] = field(default_factory=list)

    def step(self, books: Books, now: float) -> list[Send]:
        sends: list[Send] = []
        demand = up(self.active, PAGE)
        if self.pending is None:
            self.in_use = min(demand, self.lease)
            self.held = self.lease
        else:
            if now - self.pending_since >= self.release_after_s:
                self.in_use = min(self.in_use, demand, self.lease)
            self.held = max(self.in_use, self.lease)
        # Requests that wait ask for their blocks and the reserve; otherwise only the ready
        # pages the cache does not cover.
        ahead = max(0, RESERVE - (self.held - self.in_use))
        wanted = up(demand + RESERVE if demand > self.lease else self.held + ahead, CHUNK)
        if wanted > self.lease and now >= self.next_ask:
            self.asks += 1
            sends += books.want(self.id, self.asks, wanted, now)
            self.next_ask = now + (0.5 if self.active else 5.0)
        ack = 0
        if self.pending is not None and self.held <= self.pending.limit:
            ack, self.pending = self.pending.seq, None
        cached = self.held - self.in_use
        report = Report(mapped=self.held, used=self.held, cached=cached, reserved=0, ack=ack)
        return sends + books.report(self.id, report, now)

    def receive(self, message: object, now: float) -> None:
        if isinstance(message, Lease):
            self.lease = message.limit
        elif isinstance(message, Reclaim):
            self.lease = message.limit
            if self.pending is None:
                self.pending_since = now
            self.pending = message
        self.leases.append(self.lease)


class Counting(BrokerEvents):
    def __init__(self) -> None:
        self.reclaims: list[float] = []
        self.ungranted = 0
        self.now = 0.0

    def reclaim_issued(self, gpu: str) -> None:
        self.reclaims.append(self.now)

    def reclaim_ungranted(self, gpu: str) -> None:
        self.ungranted += 1


def run(policy: str, servers: list[CachingServer], seconds: float) -> Counting:
    events = Counting()
    books = Books(
        [GPU],
        headroom=HEADROOM,
        reclaim_deadline_s=DEADLINE_S,
        events=events,
        policy=policy_named(policy),
    )
    by_id: dict[int, CachingServer] = {}
    for pid, server in enumerate(servers, start=100):
        hello = Hello(
            version=1, gpu=GPU.uuid, page_size=PAGE, kv_min=4 * MIB, kv_max=None,
            priority=100, static=0, namespace="ns", pod=f"server-{pid}",
        )  # fmt: skip
        admitted = books.admit(hello, pid, 0.0)
        assert admitted.record is not None
        server.id, server.lease = admitted.record.id, admitted.record.lease
        by_id[server.id] = server
    now = 0.0
    while now < seconds:
        events.now = now
        sends, _ = books.tick(now)
        for server in servers:
            sends += server.step(books, now)
        for send in sends:
            by_id[send.key].receive(send.message, now)
        books.check()
        assert books.view(now).gpus[0].kv_charged <= 32 * MIB
        now = round(now + STEP_S, 6)
    return events


class Quieting(CachingServer):
    """Serves ``active`` until ``until`` s, then only keeps its prefix cache."""

    until = 5.0

    def step(self, books: Books, now: float) -> list[Send]:
        if now >= self.until:
            self.active = 0
        return super().step(books, now)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_busy_server_and_an_idle_one_full_of_cache_settle(policy: str) -> None:
    # A serves steadily with 14 MiB of blocks in use; B served as much until 5 s and now
    # only keeps its prefix cache. A's ready pages come out of B's idle cache, once.
    busy, idle = CachingServer(0, active=14 * MIB), Quieting(0, active=14 * MIB)
    events = run(policy, [busy, idle], seconds=120.0)
    late = [t for t in events.reclaims if t >= 5.0 + DEADLINE_S]
    assert late == [], f"{len(late)} reclaims after the leases should have settled"
    assert busy.lease + idle.lease == 32 * MIB
    assert events.ungranted == 0
    if policy == "entitlement":
        # Idle memory is lent: the busy server's ready pages come out of B's cache (no more
        # than it asked for). fair-share counts a pool's cache as its demand and leaves it.
        assert busy.lease == up(14 * MIB + RESERVE, CHUNK)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_servers_full_of_cache_take_nothing_from_each_other(policy: str) -> None:
    a, b = CachingServer(0, active=2 * MIB), CachingServer(0, active=3 * MIB)
    events = run(policy, [a, b], seconds=60.0)
    assert events.reclaims == [], "a reclaim evicted one server's cache for the other's"


def test_a_reclaim_whose_pool_stops_asking_is_called_off_and_counted() -> None:
    # A holds its memory in blocks in use (long requests); B's requests come in short
    # bursts: every 3 s it asks for its entitlement once and stops asking before A's
    # requests finish. Each reclaim of A is called off (A keeps what it holds, as its
    # lease) and counted as one that granted nothing.
    events = Counting()
    books = Books([GPU], headroom=HEADROOM, reclaim_deadline_s=DEADLINE_S, events=events)
    ids = {}
    for pid, pod in ((100, "a"), (101, "b")):
        hello = Hello(
            version=1, gpu=GPU.uuid, page_size=PAGE, kv_min=0, kv_max=None, priority=100,
            static=0, namespace="ns", pod=pod,
        )  # fmt: skip
        record = books.admit(hello, pid, 0.0).record
        assert record is not None
        ids[pod] = record.id
    a, b = ids["a"], ids["b"]
    books.want(a, 1, 32 * MIB, 0.0)
    in_use = Report(mapped=32 * MIB, used=32 * MIB, cached=0, reserved=0)
    books.report(a, in_use, 0.0)
    for burst in range(10):
        now = 3.0 * burst + 1.0
        events.now = now
        books.want(b, burst + 2, 16 * MIB, now)  # once: the burst is over before ...
        assert books.pool(a).lease == 16 * MIB  # type: ignore[union-attr]
        sends = books.report(a, in_use, now + 1.5)  # ... A has released anything
        assert [s.message for s in sends] == [Lease(seq=0, limit=32 * MIB, reason="granted")]
        books.check()
    assert books.pool(b).lease == 0  # type: ignore[union-attr]
    assert len(events.reclaims) == events.ungranted == 10
