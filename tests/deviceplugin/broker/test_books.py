"""The broker's books: admission, grants, fair-share reclaims, deadlines, turns, drain,
recovery, and the invariant that memory changes hands only after it was released."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvshare.api.wire import Hello, Lease, Reclaim, Report, TurnGranted, TurnRefused, TurnRequest
from kvshare.deviceplugin.broker.books import (
    Books,
    BrokerEvents,
    ExpectedPool,
    PoolRecord,
    Send,
)
from kvshare.deviceplugin.broker.policy import FairShare, GpuState, Policy, PoolState, fair_shares
from kvshare.deviceplugin.inventory import GpuInfo

GIB = 2**30
PAGE = 2 * 2**20
GPU = GpuInfo(uuid="GPU-test-0", index=0, name="test", total_bytes=16 * GIB)


def hello(pod: str, **overrides: object) -> Hello:
    fields: dict[str, object] = {
        "version": 1,
        "gpu": GPU.uuid,
        "page_size": PAGE,
        "kv_min": GIB,
        "kv_max": None,
        "priority": 100,
        "static": 2 * GIB,
        "namespace": "ns",
        "pod": pod,
    }
    fields.update(overrides)
    return Hello(**fields)  # type: ignore[arg-type]


class RecordingEvents(BrokerEvents):
    def __init__(self) -> None:
        self.overdue: list[str] = []
        self.completed: list[float] = []

    def reclaim_overdue(self, pool: PoolRecord) -> None:
        self.overdue.append(pool.name)

    def reclaim_completed(self, gpu: str, seconds: float) -> None:
        self.completed.append(seconds)


def admit(books: Books, pod: str, pid: int, now: float = 0.0, **overrides: object) -> int:
    admission = books.admit(hello(pod, **overrides), pid, now)
    assert admission.record is not None, admission.reason
    return admission.record.id


def leases(sends: list[Send]) -> dict[int, int]:
    return {s.key: s.message.limit for s in sends if isinstance(s.message, Lease)}


def reclaims(sends: list[Send]) -> dict[int, Reclaim]:
    return {s.key: s.message for s in sends if isinstance(s.message, Reclaim)}


def ack(books: Books, pool_id: int, reclaim: Reclaim, now: float) -> list[Send]:
    return books.report(
        pool_id, Report(mapped=reclaim.limit, used=0, cached=0, reserved=0, ack=reclaim.seq), now
    )


def test_admission_guarantees_min_and_refuses_what_cannot_fit() -> None:
    books = Books([GPU], headroom=GIB)
    first = books.admit(hello("a", kv_min=4 * GIB, static=6 * GIB), 10, 0.0)
    assert first.record is not None
    assert first.record.lease == 4 * GIB  # the minimum is granted at once
    refused = books.admit(hello("b", kv_min=4 * GIB, static=2 * GIB), 11, 0.0)
    assert refused.record is None
    assert refused.reason.startswith("fit: static 2.0Gi + kv min 4.0Gi does not fit on GPU 0")
    assert "5.0Gi left of 16.0Gi" in refused.reason
    books.check()


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"version": 99}, "protocol version 99 is not supported"),
        ({"gpu": "GPU-elsewhere"}, "unknown GPU 'GPU-elsewhere'"),
        ({"page_size": 1000}, "page size 1000"),
        ({"kv_max": GIB // 2}, "kv max 512.0Mi is below kv min 1.0Gi"),
        ({"priority": 5000}, "priority 5000 is outside 0-1000"),
    ],
)
def test_bad_hellos_are_refused_with_a_reason(overrides: dict[str, object], fragment: str) -> None:
    books = Books([GPU], headroom=GIB)
    admission = books.admit(hello("a", **overrides), 10, 0.0)
    assert admission.record is None
    assert fragment in admission.reason
    assert books.pools() == []


def test_growth_is_granted_while_free_page_aligned_and_capped_at_max() -> None:
    books = Books([GPU], headroom=GIB)
    pool = admit(books, "a", 10, kv_max=5 * GIB + 3 * PAGE + 1)
    sends = books.want(pool, 1, 3 * GIB + 1, 1.0)
    assert sends == [Send("pool", pool, Lease(seq=1, limit=3 * GIB + PAGE, reason="granted"))]
    sends = books.want(pool, 2, 20 * GIB, 2.0)
    assert leases(sends) == {pool: 5 * GIB + 3 * PAGE}
    assert sends[0].message.reason.startswith("max:")


def test_contention_reclaims_lowest_priority_first_and_hands_over_only_after_release() -> None:
    books = Books([GPU], headroom=GIB)  # budget: 16 - 1 - 3 * 2 static = 9 GiB
    low = admit(books, "low", 10, priority=10)
    mid = admit(books, "mid", 11, priority=50)
    assert leases(books.want(low, 1, 4 * GIB, 1.0)) == {low: 4 * GIB}
    assert leases(books.want(mid, 1, 4 * GIB, 1.0)) == {mid: 4 * GIB}
    high = admit(books, "high", 12, priority=500)
    sends = books.want(high, 1, 4 * GIB, 2.0)
    # 0 unleased: the newcomer got only its guaranteed minimum, taken from nobody's lease
    # (min is set aside at admission) ... and its growth waits for a reclaim from "low".
    assert leases(sends) == {high: GIB}
    asked = reclaims(sends)
    assert set(asked) == {low}
    assert books.view(2.0).gpus[0].unleased >= 0
    # Nothing is handed over before "low" says it released the memory.
    assert books.pool(high).lease == GIB  # type: ignore[union-attr]
    granted = leases(ack(books, low, asked[low], 3.0))
    assert granted[high] > GIB
    books.check()
    assert books.view(3.0).gpus[0].unleased >= 0


def test_a_missed_deadline_is_reported_and_the_memory_stays_charged() -> None:
    events = RecordingEvents()
    books = Books([GPU], headroom=GIB, reclaim_deadline_s=5.0, events=events)
    hog = admit(books, "hog", 10, priority=1)
    books.want(hog, 1, 8 * GIB, 0.0)
    books.report(hog, Report(mapped=8 * GIB, used=0, cached=0, reserved=0), 0.0)
    other = admit(books, "other", 11, priority=100)
    asked = reclaims(books.want(other, 1, 4 * GIB, 1.0))
    assert hog in asked
    charged = books.pool(hog).charge  # type: ignore[union-attr]
    _, removed = books.tick(7.0)
    assert events.overdue == ["ns/hog"]
    assert removed == []
    view = {p.name: p for p in books.view(7.0).pools}
    assert view["ns/hog"].reclaim_overdue
    assert view["ns/hog"].charged == charged  # not silently handed to "other"
    assert books.view(7.0).gpus[0].unleased >= 0
    # A late release still completes the reclaim and clears the flag.
    ack(books, hog, asked[hog], 9.0)
    assert not {p.name: p for p in books.view(9.0).pools}["ns/hog"].reclaim_overdue
    assert events.completed == [pytest.approx(8.0)]


def test_a_pool_that_leaves_returns_its_lease_to_waiters() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    b = admit(books, "b", 11)
    books.want(a, 1, 10 * GIB, 0.0)  # budget 16 - 1 - 2 * 2 = 11 GiB, 1 GiB set aside for b
    books.report(a, Report(mapped=10 * GIB, used=10 * GIB, cached=0, reserved=0), 0.0)
    books.want(b, 1, 2 * GIB, 1.0)  # a's blocks are in use: b waits
    assert books.pool(b).lease == GIB  # type: ignore[union-attr]
    sends = books.remove(a, "exited", 2.0)
    assert leases(sends) == {b: 2 * GIB}
    books.check()


def test_a_pool_that_asks_for_no_more_than_its_lease_stops_waiting() -> None:
    # Beyond the entitlements, memory that comes free goes to the longest waiting first. A
    # pool that says it needs no more than it holds is no longer waiting: asking for more
    # later puts it behind the pools that waited meanwhile, whatever it asked before.
    books = Books([GPU], headroom=GIB)  # budget 16 - 1 - 4 * 2 static = 7 GiB
    hog = admit(books, "hog", 10)
    a = admit(books, "a", 11)
    b = admit(books, "b", 12)
    admit(books, "quiet", 13)
    books.want(hog, 1, 4 * GIB, 0.0)  # 1 GiB set aside for each of the others
    books.report(hog, Report(mapped=4 * GIB, used=4 * GIB, cached=0, reserved=0), 0.0)
    books.want(a, 1, 8 * GIB, 1.0)  # the hog's blocks are in use: both wait
    books.want(b, 1, 8 * GIB, 1.1)
    assert books.pool(a).lease == books.pool(b).lease == GIB  # type: ignore[union-attr]
    books.want(a, 2, GIB, 1.2)  # a needs no more than it holds
    books.want(a, 3, 8 * GIB, 1.3)  # ... and then more again: it waits behind b
    # The hog leaves: 9 GiB to lend, 3 GiB each entitled, the quiet pool holds 1 GiB.
    got = leases(books.remove(hog, "exited", 1.4))
    assert got == {a: 3 * GIB, b: 5 * GIB}
    books.check()


def test_startup_turns_go_one_at_a_time_and_reserve_room() -> None:
    books = Books([GPU], headroom=GIB)
    first = books.turn_request(1, TurnRequest(seq=1, gpu=GPU.uuid, static=4 * GIB), 100, 0.0)
    assert [s.message for s in first] == [
        TurnGranted(seq=1, hold_s=600.0, gpu_total=GPU.total_bytes)
    ]  # the GPU's memory, for a pool with no device to read it from
    second = books.turn_request(2, TurnRequest(seq=1, gpu=GPU.uuid, static=4 * GIB), 101, 0.0)
    assert second == []  # queued behind the first
    assert books.view(0.0).gpus[0].static == 4 * GIB
    # The engine's pool takes over the reservation instead of counting it twice.
    pool = admit(books, "engine", 100, static=4 * GIB, kv_min=GIB)
    assert books.view(0.0).gpus[0].static == 4 * GIB
    done = books.turn_done(1, 1.0)
    assert [s.key for s in done if isinstance(s.message, TurnGranted)] == [2]
    books.check()
    assert books.pool(pool) is not None


def test_a_startup_turn_waits_for_reclaimed_room_and_refuses_what_never_fits() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    books.want(a, 1, 12 * GIB, 0.0)  # borrows everything
    sends = books.turn_request(7, TurnRequest(seq=1, gpu=GPU.uuid, static=4 * GIB), 99, 1.0)
    asked = reclaims(sends)
    assert a in asked and not any(isinstance(s.message, TurnGranted) for s in sends)
    granted = ack(books, a, asked[a], 2.0)
    assert any(s.key == 7 and isinstance(s.message, TurnGranted) for s in granted)
    refused = books.turn_request(8, TurnRequest(seq=2, gpu=GPU.uuid, static=14 * GIB), 98, 3.0)
    assert isinstance(refused[0].message, TurnRefused)
    assert "does not fit" in refused[0].message.reason


def test_drain_reclaims_to_min_and_refuses_new_pools() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    books.want(a, 1, 6 * GIB, 0.0)
    asked = reclaims(books.set_draining(GPU.uuid, True, 1.0))
    assert asked[a].limit == GIB
    assert "draining" in books.admit(hello("b"), 11, 1.0).reason
    ack(books, a, asked[a], 2.0)
    denied = books.want(a, 2, 6 * GIB, 3.0)
    assert denied[0].message.reason.startswith("draining")
    assert leases(books.set_draining(GPU.uuid, False, 4.0)) == {a: 6 * GIB}


def test_lowering_max_reclaims_down_to_it() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    books.want(a, 1, 6 * GIB, 0.0)
    asked = reclaims(books.set_max(a, 3 * GIB, 1.0))
    assert asked[a].limit == 3 * GIB
    with pytest.raises(ValueError, match="below pool ns/a's kv min"):
        books.set_max(a, GIB // 4, 1.0)


def test_raising_max_grants_what_the_pool_asked_beyond_the_old_one() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10, kv_max=2 * GIB)
    answer = books.want(a, 1, 6 * GIB, 0.0)
    assert answer[0].message.limit == 2 * GIB and answer[0].message.reason.startswith("max")
    # The pool does not ask again (it was told it is at its max): the books remember.
    assert leases(books.set_max(a, 5 * GIB, 0.5)) == {a: 5 * GIB}
    assert leases(books.set_max(a, None, 1.0)) == {a: 6 * GIB}
    books.check()


def test_a_policy_changed_in_place_moves_cap_minimum_and_priority() -> None:
    books = Books([GPU], headroom=GIB)  # 15 GiB to lend after headroom
    a = admit(books, "a", 10, kv_max=8 * GIB)
    b = admit(books, "b", 11, priority=100)
    books.want(a, 1, 8 * GIB, 0.0)
    # A lower cap reclaims; a higher minimum is guaranteed (granted) at once.
    sends = books.set_policy(a, 2 * GIB, 3 * GIB, 500, 1.0)
    assert reclaims(sends)[a].limit == 3 * GIB
    record = books.pool(a)
    assert record is not None
    assert (record.kv_min, record.kv_max, record.priority) == (2 * GIB, 3 * GIB, 500)
    assert books.view(1.0).gpus[0].kv_min == 3 * GIB  # a's 2 GiB and b's 1 GiB
    # Raising b's minimum beyond what the GPU can still guarantee changes nothing.
    free = books.view(1.0).gpus[0].free
    with pytest.raises(ValueError, match="cannot guarantee"):
        books.set_policy(b, GIB + free + PAGE, None, 100, 2.0)
    record_b = books.pool(b)
    assert record_b is not None and (record_b.kv_min, record_b.priority) == (GIB, 100)
    with pytest.raises(ValueError, match="below the kv min"):
        books.set_policy(b, 2 * GIB, GIB, 100, 2.0)
    with pytest.raises(ValueError, match="priority"):
        books.set_policy(b, GIB, None, 1001, 2.0)
    books.check()


def test_after_a_restart_nothing_is_granted_until_every_pool_re_declared() -> None:
    expected = [ExpectedPool(pid=10, name="ns/a", gpu=GPU.uuid, static=2 * GIB, kv_min=GIB)]
    books = Books([GPU], headroom=GIB, expected=expected, recovery_deadline=30.0)
    assert books.recovering
    newcomer = admit(books, "new", 20)
    denied = books.want(newcomer, 1, 4 * GIB, 1.0)
    assert denied[0].message.reason.startswith("recovering")
    resumed = books.admit(hello("a", resume=True, held=6 * GIB, lease=7 * GIB), 10, 2.0)
    assert resumed.record is not None and resumed.record.lease == 7 * GIB
    assert not books.recovering
    # Recovery over: the waiting newcomer is served from what is left.
    assert leases(resumed.sends)[newcomer] > GIB
    books.check()


def test_recovery_gives_up_on_pools_that_never_return() -> None:
    expected = [ExpectedPool(pid=10, name="ns/a", gpu=GPU.uuid, static=2 * GIB, kv_min=GIB)]
    books = Books([GPU], headroom=GIB, expected=expected, recovery_deadline=30.0)
    books.tick(31.0)
    assert not books.recovering


@pytest.mark.parametrize(
    ("capacity", "pools", "expected"),
    [
        (10, [(1, 1, 10, 1), (2, 1, 10, 1)], {1: 5, 2: 5}),
        (10, [(1, 1, 2, 1), (2, 1, 10, 1)], {1: 2, 2: 8}),
        (12, [(1, 0, 12, 1), (2, 0, 12, 3)], {1: 3, 2: 9}),
        (4, [(1, 3, 3, 1), (2, 3, 9, 1)], {1: 3, 2: 3}),
    ],
)
def test_fair_shares_are_weighted_max_min(
    capacity: int, pools: list[tuple[int, int, int, int]], expected: dict[int, int]
) -> None:
    assert fair_shares(capacity, pools) == expected


# --- property: compliant pools never over-commit the GPU --------------------------------


@dataclass
class SimPool:
    """A pool process that holds at most its lease and releases when reclaimed."""

    id: int
    lease: int = 0
    held: int = 0
    pending: list[Reclaim] = field(default_factory=list)


def deliver(pools: dict[int, SimPool], sends: list[Send]) -> None:
    for send in sends:
        pool = pools.get(send.key)
        if pool is None or send.to != "pool":
            continue
        if isinstance(send.message, Lease):
            pool.lease = send.message.limit
        elif isinstance(send.message, Reclaim):
            pool.lease = send.message.limit
            pool.pending.append(send.message)


_start = st.tuples(st.just("start"), st.integers(0, 1000), st.integers(0, 3), st.integers(0, 3))
_want = st.tuples(st.just("want"), st.integers(0, 7), st.integers(0, 14 * 1024))
operation = st.one_of(
    _start,
    _start,
    _want,
    _want,
    _want,
    st.tuples(st.just("use"), st.integers(0, 7), st.floats(0, 1)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("release-part"), st.integers(0, 7), st.floats(0, 1)),
    st.tuples(st.just("leave"), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.floats(0, 20)),
    st.tuples(st.just("drain"), st.booleans()),
)


class Node:
    """Engines that start the way real ones do (start-up turn, then the pool's hello) and
    pools that hold at most their lease and release what is reclaimed."""

    def __init__(self, policy: Policy | None = None, kv_max: int | None = None) -> None:
        self.books = Books([GPU], headroom=GIB, reclaim_deadline_s=5.0, policy=policy)
        self.kv_max = kv_max
        self.pools: dict[int, SimPool] = {}
        self.starting: dict[int, Hello] = {}
        self.now = 0.0
        # Connection keys (and pids) are never reused while a connection lives, as the
        # broker's are: a key made from counts would repeat once a pool leaves.
        self._keys = itertools.count(1000)

    def deliver(self, sends: list[Send]) -> None:
        deliver(self.pools, sends)
        for send in sends:
            if send.to == "turn" and isinstance(send.message, TurnGranted):
                self.started(send.key)

    def start(self, priority: int, min_gib: int, static_gib: int) -> None:
        key = next(self._keys)
        engine = hello(
            f"p{key}",
            priority=priority,
            kv_min=min_gib * GIB,
            kv_max=None if self.kv_max is None else max(self.kv_max, min_gib * GIB),
            static=static_gib * GIB,
        )
        self.starting[key] = engine
        request = TurnRequest(seq=1, gpu=GPU.uuid, static=engine.static, kv_min=engine.kv_min)
        sends = self.books.turn_request(key, request, key, self.now)
        if any(isinstance(s.message, TurnRefused) for s in sends):
            del self.starting[key]
        self.deliver(sends)

    def started(self, key: int) -> None:
        engine = self.starting.pop(key)
        result = self.books.admit(engine, key, self.now)
        assert result.record is not None, result.reason
        self.pools[result.record.id] = SimPool(result.record.id, lease=result.record.lease)
        self.deliver(result.sends)
        self.deliver(self.books.turn_done(key, self.now))


class Reckless:
    """A policy that asks for everything: every pool grown past the GPU, every pool
    reclaimed to nothing. The books must keep their rules whatever a policy decides."""

    name = "reckless"

    def ask(self, pool: PoolState) -> int:
        return 2**62

    def grants(self, gpu: GpuState) -> list[tuple[int, int]]:
        return [(p.id, 2 * gpu.budget + 1) for p in gpu.pools]

    def reclaims(self, gpu: GpuState) -> dict[int, int]:
        return {p.id: -1 for p in gpu.pools}

    def waiting_for(self, gpu: GpuState) -> dict[int, int]:
        return {p.id: gpu.budget for p in gpu.pools}


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, min_size=10, max_size=80))
# Two engines waiting for their turn while a pool leaves, then a third: each is its own
# connection (a harness that reused a key here lost one engine's turn).
@example(
    [
        *([("start", 0, 0, 0)] * 4),
        ("want", 0, 3073),
        ("start", 0, 3, 3),
        ("start", 0, 3, 3),
        ("leave", 1),
        ("start", 0, 0, 0),
        ("release", 0),
    ]
)
def test_compliant_pools_never_hold_more_than_the_budget(ops: list[tuple[object, ...]]) -> None:
    run_node(Node(), ops)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, min_size=10, max_size=80))
def test_the_books_keep_their_rules_whatever_the_policy_decides(
    ops: list[tuple[object, ...]],
) -> None:
    node = Node(Reckless(), kv_max=5 * GIB)
    run_node(node, ops)
    for record in node.books.pools():
        assert record.lease >= record.kv_min


def run_node(node: Node, ops: list[tuple[object, ...]]) -> None:
    """Apply ``ops`` to ``node``, checking after each that compliant pools never hold
    more than the GPU's budget, every byte held is charged, and leases respect kv max."""
    books, pools = node.books, node.pools
    for op in ops:
        kind = op[0]
        if kind == "start":
            node.start(int(op[1]), int(op[2]), int(op[3]))  # type: ignore[call-overload]
        elif pools and kind in ("want", "use", "release", "release-part", "leave"):
            pool = list(pools.values())[int(op[1]) % len(pools)]  # type: ignore[call-overload]
            if kind == "want":
                node.deliver(books.want(pool.id, 1, int(op[2]) * 2**20, node.now))  # type: ignore[call-overload]
            elif kind == "use":
                pool.held = int(pool.lease * float(op[2])) // PAGE * PAGE  # type: ignore[arg-type]
                node.deliver(books.report(pool.id, Report(pool.held, pool.held, 0, 0), node.now))
            elif kind == "release" and pool.pending:
                reclaim = pool.pending.pop()
                pool.pending.clear()
                pool.held = min(pool.held, reclaim.limit)
                report = Report(pool.held, pool.held, 0, 0, ack=reclaim.seq)
                node.deliver(books.report(pool.id, report, node.now))
            elif kind == "release-part" and pool.pending and pool.held > pool.lease:
                # Part of the way down, with the latest reclaim in force.
                reclaim = pool.pending[-1]
                step = int((pool.held - pool.lease) * float(op[2])) // PAGE * PAGE  # type: ignore[arg-type]
                pool.held -= step
                report = Report(pool.held, pool.held, 0, 0, ack=reclaim.seq)
                node.deliver(books.report(pool.id, report, node.now))
            elif kind == "leave":
                del pools[pool.id]
                node.deliver(books.remove(pool.id, "bye", node.now))
        elif kind == "tick":
            node.now += float(op[1])  # type: ignore[arg-type]
            sends, _ = books.tick(node.now)
            node.deliver(sends)
        elif kind == "drain":
            node.deliver(books.set_draining(GPU.uuid, bool(op[1]), node.now))
        books.check()
        gpu = books.view(node.now).gpus[0]
        budget = gpu.total - gpu.headroom - gpu.static
        # What the pools physically hold never exceeds what the GPU can give them...
        assert sum(p.held for p in pools.values()) <= budget
        # ... because every byte held is charged, and charges never exceed the budget.
        assert gpu.unleased >= 0
        for sim in pools.values():
            record = books.pool(sim.id)
            assert record is not None
            assert sim.held <= record.charge
            assert record.lease == sim.lease
            assert record.kv_max is None or record.lease <= max(record.kv_max, record.kv_min)


def test_an_engine_that_skipped_its_turn_makes_the_broker_reclaim_room_for_its_weights() -> None:
    books = Books([GPU], headroom=GIB, policy=FairShare())
    borrower = admit(books, "borrower", 10, static=0, kv_min=0)
    books.want(borrower, 1, 14 * GIB, 0.0)
    late = books.admit(hello("late", static=4 * GIB, kv_min=GIB), 11, 1.0)
    assert late.record is not None
    assert books.view(1.0).gpus[0].unleased < 0  # the weights are on the GPU already
    asked = reclaims(late.sends)
    assert asked[borrower].limit <= 14 * GIB - 5 * GIB


def test_a_reclaim_into_blocks_in_use_stands_until_the_pool_has_released_them() -> None:
    events = RecordingEvents()
    books = Books([GPU], headroom=GIB, reclaim_deadline_s=5.0, events=events, policy=FairShare())
    a = admit(books, "a", 10, priority=1)
    books.want(a, 1, 8 * GIB, 0.0)
    books.report(a, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 0.0)
    b = admit(books, "b", 11, priority=500)
    asked = reclaims(books.want(b, 1, 8 * GIB, 1.0))[a]
    before = books.pool(b).lease  # type: ignore[union-attr]
    # Meanwhile A's engine filled more blocks under its old lease: the pool releases them
    # as their requests finish, so the broker neither lowers its demand nor hands the
    # memory on before the release.
    used = asked.limit + GIB
    assert reclaims(books.report(a, Report(used, used, 0, 0), 2.0)) == {}
    assert books.pool(b).lease == before  # type: ignore[union-attr]
    granted = leases(ack(books, a, asked, 3.0))
    assert granted[b] > before
    assert events.overdue == []
    books.check()


def in_use(books: Books, pod: str, pid: int, nbytes: int, **overrides: object) -> int:
    """Admit a pool without a minimum that leases ``nbytes`` and has blocks in all of it."""
    pool = admit(books, pod, pid, **{"kv_min": 0, **overrides})
    books.want(pool, 1, nbytes, 0.0)
    books.report(pool, Report(mapped=nbytes, used=nbytes, cached=0, reserved=0), 0.0)
    return pool


def test_a_reclaim_for_a_pool_whose_ask_lapsed_is_called_off() -> None:
    # The default policy stops counting an ask not heard again for a second (the pool's
    # burst ended; pools never say they want less). A reclaim made only for that ask is
    # no longer needed: the busy pool keeps its blocks and its lease.
    books = Books([GPU], headroom=GIB)
    busy = in_use(books, "busy", 10, 11 * GIB)
    bursty = admit(books, "bursty", 11, kv_min=0)
    assert busy in reclaims(books.want(bursty, 1, 8 * GIB, 1.0))
    books.report(busy, Report(mapped=11 * GIB, used=11 * GIB, cached=0, reserved=0), 5.0)
    assert books.pool(busy).reclaim is None  # type: ignore[union-attr]
    assert books.pool(busy).lease == 11 * GIB  # type: ignore[union-attr]
    reply = books.want(busy, 2, 11 * GIB, 5.0)[0].message
    assert reply.reason == "granted"  # not "reclaiming"
    assert busy in reclaims(books.want(bursty, 2, 8 * GIB, 6.0))  # asking again counts
    books.check()


def test_reconnecting_does_not_move_a_reclaim_s_deadline() -> None:
    events = RecordingEvents()
    # fair-share: the waiter's ask stands however long it waits, so the reclaim does too.
    books = Books([GPU], headroom=GIB, reclaim_deadline_s=5.0, events=events, policy=FairShare())
    slow = in_use(books, "slow", 10, 11 * GIB)
    waiter = admit(books, "waiter", 11, kv_min=0)
    assert slow in reclaims(books.want(waiter, 1, 8 * GIB, 1.0))  # due at 6.0
    claim = hello("slow", kv_min=0, resume=True, held=11 * GIB, lease=11 * GIB)
    resent = reclaims(books.admit(claim, 10, 4.0).sends)[slow]  # it reconnected
    assert resent.deadline_s == pytest.approx(2.0)  # what is left, not a new deadline
    books.tick(6.5)
    assert events.overdue == ["ns/slow"]
    books.admit(claim, 10, 7.0)
    assert books.pool(slow).reclaim.overdue  # type: ignore[union-attr]
    books.check()


def test_what_a_reclaimed_pool_already_released_goes_on_before_the_rest() -> None:
    books = Books([GPU], headroom=GIB, policy=FairShare())  # budget 11 GiB
    a = in_use(books, "a", 10, 11 * GIB)
    b = admit(books, "b", 11, kv_min=0)
    asked = reclaims(books.want(b, 1, 11 * GIB, 1.0))[a]
    assert asked.limit == 11 * GIB // 2
    # A report from before the reclaim took effect proves nothing: the pool may have grown.
    assert leases(books.report(a, Report(8 * GIB, 8 * GIB, 0, 0), 1.5)) == {}
    # Made with the reclaim in force: what it shows given back is free at once.
    assert leases(books.report(a, Report(8 * GIB, 8 * GIB, 0, 0, ack=asked.seq), 2.0)) == {
        b: 3 * GIB
    }
    assert books.pool(a).charge == 8 * GIB  # type: ignore[union-attr]
    books.check()
    half = 11 * GIB // 2
    granted = leases(books.report(a, Report(half, half, 0, 0, ack=asked.seq), 3.0))
    assert granted == {b: half}
    assert books.pool(a).reclaim is None  # type: ignore[union-attr]
    books.check()


def test_idle_lease_of_a_quiet_pool_goes_to_a_waiter_in_one_round() -> None:
    books = Books([GPU], headroom=GIB)  # budget 11 GiB for two pools with 2 GiB static each
    quiet = admit(books, "quiet", 10, kv_min=0)
    books.want(quiet, 1, 9 * GIB, 0.0)  # its burst is over: 9 GiB leased, 1 GiB held
    books.report(quiet, Report(mapped=GIB, used=GIB // 2, cached=0, reserved=0), 1.0)
    busy = admit(books, "busy", 11, kv_min=0)
    sends = books.want(busy, 1, 10 * GIB, 2.0)
    assert leases(sends) == {busy: 2 * GIB}  # what was unleased, at once
    asked = reclaims(sends)
    # Not one chunk at a time: all the busy pool is short of, from what the quiet pool
    # neither holds nor uses, in one reclaim.
    assert asked[quiet].limit == GIB
    granted = leases(ack(books, quiet, asked[quiet], 2.01))
    assert granted[busy] == 10 * GIB
    books.check()


def test_idle_lease_is_taken_before_blocks_in_use_whatever_the_priorities() -> None:
    books = Books(
        [GPU], headroom=GIB, policy=FairShare()
    )  # three pools with 2 GiB static: budget 9 GiB
    low = admit(books, "low", 10, kv_min=0, priority=10)
    books.want(low, 1, 4 * GIB, 0.0)
    books.report(low, Report(mapped=4 * GIB, used=4 * GIB, cached=0, reserved=0), 0.0)
    idle = admit(books, "idle", 11, kv_min=0, priority=100)
    books.want(idle, 1, 4 * GIB, 0.0)
    books.report(idle, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 0.0)
    waiter = admit(books, "waiter", 12, kv_min=0, priority=100)
    asked = reclaims(books.want(waiter, 1, 3 * GIB, 1.0))
    assert asked.keys() == {idle} and asked[idle].limit == 2 * GIB


def test_a_drain_reaches_the_minimum_even_with_blocks_in_use_above_it() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    books.want(a, 1, 6 * GIB, 0.0)
    books.report(a, Report(mapped=4 * GIB, used=4 * GIB, cached=0, reserved=0), 0.0)
    asked = reclaims(books.set_draining(GPU.uuid, True, 1.0))
    assert asked[a].limit == GIB
    # Its blocks are still in use: the drain waits for them instead of settling for less.
    assert reclaims(books.report(a, Report(4 * GIB, 4 * GIB, 0, 0), 2.0)) == {}
    ack(books, a, asked[a], 5.0)
    assert books.pool(a).lease == GIB and books.pool(a).reclaim is None  # type: ignore[union-attr]
    books.check()


def test_memory_in_use_above_a_fair_share_is_reclaimed_down_to_the_share() -> None:
    books = Books([GPU], headroom=GIB, policy=FairShare())  # budget 11 GiB
    a = in_use(books, "a", 10, 11 * GIB)
    b = admit(books, "b", 11, kv_min=0)
    asked = reclaims(books.want(b, 1, 8 * GIB, 1.0))
    # Both have a queue, same priority: each gets half, blocks in use or not.
    assert asked[a].limit == 11 * GIB // 2
    granted = leases(ack(books, a, asked[a], 4.0))
    assert granted[b] == 11 * GIB // 2
    books.check()


def test_a_pool_within_its_fair_share_keeps_its_blocks_in_use() -> None:
    books = Books([GPU], headroom=GIB)  # budget 11 GiB
    a = admit(books, "a", 10, kv_min=0)
    books.want(a, 1, 3 * GIB, 0.0)
    books.report(a, Report(mapped=3 * GIB, used=3 * GIB, cached=0, reserved=0), 0.0)
    b = admit(books, "b", 11, kv_min=0)
    books.want(b, 1, 8 * GIB, 1.0)
    sends = books.want(b, 2, 11 * GIB, 2.0)
    assert reclaims(sends) == {}  # a's fair share covers what it uses
    assert books.pool(a).lease == 3 * GIB  # type: ignore[union-attr]


def test_an_unknown_pool_re_declaring_memory_gets_only_unleased_memory() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10)
    books.want(a, 1, 8 * GIB, 0.0)
    claim = hello("a", resume=True, held=11 * GIB, lease=11 * GIB)  # never admitted here
    impostor = books.admit(claim, 99, 1.0)
    assert impostor.record is not None and impostor.record.id != a
    assert impostor.record.lease <= books.view(1.0).gpus[0].unleased + impostor.record.lease
    assert reclaims(impostor.sends).keys() == {impostor.record.id}  # asked to shrink itself
    assert books.pool(a).lease == 8 * GIB and books.pool(a).reclaim is None  # type: ignore[union-attr]
    books.check()


def test_an_unknown_pool_re_declaring_memory_while_the_books_recover_is_lent_nothing() -> None:
    # Until every expected pool has re-declared, unleased memory still holds theirs.
    expected = [ExpectedPool(pid=50, name="ns/known", gpu=GPU.uuid, static=2 * GIB, kv_min=GIB)]
    books = Books([GPU], headroom=GIB, expected=expected, recovery_deadline=30.0)
    claim = hello("stranger", resume=True, held=10 * GIB, lease=10 * GIB)
    stranger = books.admit(claim, 60, 0.0)
    assert stranger.record is not None
    assert stranger.record.lease == GIB  # its minimum, and it is asked to shrink to it
    assert reclaims(stranger.sends)[stranger.record.id].limit == GIB
    known = books.admit(hello("known", resume=True, held=10 * GIB, lease=10 * GIB), 50, 1.0)
    assert known.record is not None and known.record.lease == 10 * GIB
    assert books.view(1.0).gpus[0].unleased >= 0
    books.check()


def test_draining_refuses_engines_waiting_for_their_turn() -> None:
    books = Books([GPU], headroom=GIB)
    books.turn_request(1, TurnRequest(seq=1, gpu=GPU.uuid, static=GIB), 100, 0.0)
    books.turn_request(2, TurnRequest(seq=1, gpu=GPU.uuid, static=GIB), 101, 0.0)
    sends = books.set_draining(GPU.uuid, True, 1.0)
    refused = [s for s in sends if isinstance(s.message, TurnRefused)]
    assert [s.key for s in refused] == [2] and "draining" in refused[0].message.reason
    # The engine that already holds its turn may still finish starting.
    assert admit(books, "starting", 100, static=GIB, kv_min=0) > 0


def test_a_pool_without_a_minimum_keeps_the_page_of_its_null_block() -> None:
    """A pool's first page holds its null block and is never released; a reclaim below it
    could never complete, and the pool would be refused growth for good."""
    books = Books([GPU], headroom=GIB)  # budget 11 GiB
    starting = admit(books, "starting", 10, kv_min=0)
    granted = leases(books.want(starting, 1, PAGE, 0.0))  # its null block's page
    assert granted == {starting: PAGE}
    # Before it reports the page mapped, another pool asks for everything.
    busy = admit(books, "busy", 11, kv_min=0)
    sends = books.want(busy, 1, 11 * GIB, 0.1)
    assert all(r.limit >= PAGE for r in reclaims(sends).values())
    assert books.pool(starting).lease == PAGE  # type: ignore[union-attr]
    assert leases(sends) == {busy: 11 * GIB - PAGE}
    # A drain takes every pool to its minimum, and no pool below one page.
    asked = reclaims(books.set_draining(GPU.uuid, True, 1.0))
    assert starting not in asked and asked[busy].limit == PAGE
    books.check()


def test_a_pending_reclaim_is_deepened_when_the_waiter_needs_more() -> None:
    books = Books([GPU], headroom=GIB)  # budget 11 GiB
    a = in_use(books, "a", 10, 11 * GIB)
    b = admit(books, "b", 11, kv_min=0)
    books.want(b, 1, PAGE, 0.5)  # the page of its null block, reclaimed for it
    pending = books.pool(a).reclaim  # type: ignore[union-attr]
    assert pending is not None and pending.target == 11 * GIB - PAGE
    # b's queue grows before a has released anything: a is asked for more at once, down to
    # the fair share, instead of filling what is left of its lease meanwhile.
    deeper = reclaims(books.want(b, 2, 8 * GIB, 1.0))[a]
    assert deeper.limit == 11 * GIB // 2 and deeper.seq > pending.seq
    assert books.pool(a).lease == 11 * GIB // 2  # type: ignore[union-attr]
    # Acknowledging the first reclaim does not complete the deeper one.
    still = Report(11 * GIB - PAGE, 11 * GIB - PAGE, 0, 0, ack=pending.seq)
    assert leases(books.report(a, still, 1.5)) == {}
    assert books.pool(a).reclaim is not None  # type: ignore[union-attr]
    granted = leases(ack(books, a, deeper, 2.0))
    assert granted[b] == 11 * GIB // 2
    books.check()


def test_a_reclaim_nobody_needs_any_more_is_called_off() -> None:
    books = Books([GPU], headroom=GIB, policy=FairShare())  # budget 11 GiB
    a = in_use(books, "a", 10, 11 * GIB)
    b = admit(books, "b", 11, kv_min=0)
    asked = reclaims(books.want(b, 1, 8 * GIB, 1.0))[a]
    assert asked.limit < 11 * GIB
    # a's blocks are in use (say, long requests); before it releases them, b leaves.
    sends = books.remove(b, "exited", 2.0)
    assert leases(sends) == {a: 11 * GIB}  # it keeps what it holds, as its lease
    record = books.pool(a)
    assert record is not None and record.reclaim is None
    # ... and may ask for more again instead of hearing "reclaiming" for good.
    assert books.want(a, 2, 11 * GIB, 3.0)[0].message.reason == "granted"
    books.check()


GPU_1 = GpuInfo(uuid="GPU-test-1", index=1, name="test", total_bytes=16 * GIB)


def rank_asks(group: str, rank: int, gpu: GpuInfo) -> TurnRequest:
    return TurnRequest(seq=1, gpu=gpu.uuid, static=GIB, rank=rank, group=group, group_size=2)


def granted(sends: list[Send]) -> set[int]:
    return {s.key for s in sends if isinstance(s.message, TurnGranted)}


def test_tensor_parallel_groups_get_their_turns_all_at_once_in_one_order() -> None:
    books = Books([GPU, GPU_1], headroom=GIB)
    # The order that deadlocks turns given per GPU: each group's first rank asks first,
    # on the GPU the other group's second rank will want.
    assert granted(books.turn_request(1, rank_asks("a", 0, GPU), 100, 0.0)) == set()
    assert granted(books.turn_request(4, rank_asks("b", 1, GPU_1), 201, 0.0)) == set()
    assert granted(books.turn_request(2, rank_asks("a", 1, GPU_1), 101, 0.0)) == {1, 2}
    assert granted(books.turn_request(3, rank_asks("b", 0, GPU), 200, 0.0)) == set()
    assert [gpu.turn_waiting for gpu in books.view(0.0).gpus] == [1, 1]
    assert granted(books.turn_done(1, 1.0)) == set()  # group b needs both GPUs
    assert granted(books.turn_done(2, 1.0)) == {3, 4}
    books.check()


def test_a_rank_that_leaves_breaks_its_group_and_its_peers_are_refused() -> None:
    books = Books([GPU, GPU_1], headroom=GIB)
    books.turn_request(1, rank_asks("a", 0, GPU), 100, 0.0)
    refused = books.turn_done(1, 1.0)
    assert refused == []  # the group had no other rank yet
    books.turn_request(2, rank_asks("b", 0, GPU), 200, 0.0)
    books.turn_request(3, rank_asks("b", 1, GPU_1), 201, 0.0)  # b complete and granted
    books.turn_request(4, rank_asks("c", 0, GPU), 300, 0.0)
    books.turn_request(5, rank_asks("c", 1, GPU_1), 301, 0.0)  # c queues behind b
    refused = books.turn_done(5, 2.0)  # c's rank 1 dies while waiting
    assert [(s.key, type(s.message)) for s in refused] == [(4, TurnRefused)]
    assert "rank 1 of group c left" in refused[0].message.reason  # type: ignore[attr-defined]
    assert [gpu.turn_waiting for gpu in books.view(2.0).gpus] == [0, 0]


def test_a_group_asking_twice_for_a_rank_or_a_gpu_is_refused() -> None:
    books = Books([GPU, GPU_1], headroom=GIB)
    books.turn_request(1, rank_asks("a", 0, GPU), 100, 0.0)
    (twice,) = books.turn_request(2, rank_asks("a", 0, GPU_1), 101, 0.0)
    assert "rank 0 of group a has asked already" in twice.message.reason  # type: ignore[attr-defined]
    (same_gpu,) = books.turn_request(3, rank_asks("a", 1, GPU), 102, 0.0)
    assert "has a rank on GPU 0 already" in same_gpu.message.reason  # type: ignore[attr-defined]
    bad = TurnRequest(seq=1, gpu=GPU.uuid, rank=2, group="d", group_size=2)
    (refused,) = books.turn_request(4, bad, 103, 0.0)
    assert "0 <= rank < group size" in refused.message.reason  # type: ignore[attr-defined]
