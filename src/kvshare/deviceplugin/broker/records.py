"""What the broker's books record: pools, pending reclaims, start-up turns, per-GPU sums.

Plain data, mutated only by :class:`~kvshare.deviceplugin.broker.books.Books` and the
helpers it delegates to (:mod:`~kvshare.deviceplugin.broker.lending`,
:mod:`~kvshare.deviceplugin.broker.admission`, :mod:`~kvshare.deviceplugin.broker.controls`,
:mod:`~kvshare.deviceplugin.broker.turns`, :mod:`~kvshare.deviceplugin.broker.recovery`).
The policy (:mod:`~kvshare.deviceplugin.broker.policy`) never sees these: it gets frozen
snapshots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvshare.api.quantity import format_bytes_human
from kvshare.api.wire import Hello, Message, Report, TurnRequest
from kvshare.deviceplugin.broker.policy import GpuState, PoolState
from kvshare.deviceplugin.broker.views import GpuView, PoolView
from kvshare.deviceplugin.inventory import GpuInfo

__all__ = [
    "BrokerEvents",
    "ExpectedPool",
    "GpuRecord",
    "PendingReclaim",
    "PoolRecord",
    "Send",
    "Turn",
    "TurnWaiter",
    "align_down",
    "align_up",
    "size",
]

NO_USAGE = Report(mapped=0, used=0, cached=0, reserved=0)


def align_up(value: int, page: int) -> int:
    """``value`` rounded up to a multiple of ``page``."""
    return -(-value // page) * page


def align_down(value: int, page: int) -> int:
    """``value`` rounded down to a multiple of ``page``."""
    return value // page * page


def size(value: int) -> str:
    """Bytes for a log line or a reason."""
    return format_bytes_human(value)


class Send(NamedTuple):
    """A message for a pool (by pool id) or a start-up turn connection (by turn key)."""

    to: Literal["pool", "turn"]
    key: int
    message: Message


class BrokerEvents:
    """What the books report as it happens. These defaults ignore everything (the books
    alone, in tests); the node agent's metrics override them."""

    def granted(self, gpu: str, nbytes: int) -> None:
        """Lease grew by ``nbytes``."""

    def denied(self, gpu: str, reason: str) -> None:
        """A Want could not be granted in full right away."""

    def reclaim_issued(self, gpu: str) -> None:
        """A reclaim was sent to a pool."""

    def reclaim_completed(self, gpu: str, seconds: float) -> None:
        """A pool acknowledged a reclaim after ``seconds``."""

    def reclaim_overdue(self, pool: PoolRecord) -> None:
        """A pool missed a reclaim deadline."""

    def reclaim_ungranted(self, gpu: str) -> None:
        """A reclaim made for waiting pools ended (released or called off) with no other
        pool of the GPU granted memory since it was sent."""

    def admitted(self, gpu: str, resumed: bool) -> None:
        """A pool was admitted (``resumed``: re-declared after a reconnect)."""

    def refused(self, gpu: str, reason: str) -> None:
        """A pool was refused admission."""

    def removed(self, gpu: str, why: str) -> None:
        """A pool left (``bye``, ``connection closed``, ``process exited``, ...)."""

    def protocol_error(self, kind: str) -> None:
        """A connection broke the protocol (a :class:`~kvshare.api.wire.ProtocolError`
        of ``kind``) and was closed."""

    def trust_refused(self, reason: str) -> None:
        """A connection was refused by a check of who it is or of what it may hold (see
        :mod:`~kvshare.deviceplugin.broker.identity`, :mod:`~.connections.gate`)."""


@dataclass
class PendingReclaim:
    """A reclaim sent to a pool and not yet acknowledged."""

    seq: int
    target: int
    from_bytes: int
    """What the pool may still hold: its charge when the reclaim began, lowered by each
    report made with the reclaim in force, until one completes it."""
    issued_at: float
    deadline: float
    overdue: bool = False
    for_waiters: bool = False
    """Issued only because other pools waited (not for a lowered max, a drain, an engine
    starting or an over-committed GPU): called off when nobody waits any more."""
    others_granted: int = 0
    """Bytes granted to the GPU's other pools before it was sent (see
    :attr:`GpuRecord.granted_total`): more when it ends means a grant was behind it."""


@dataclass(eq=False)
class PoolRecord:
    """One admitted pool. Mutated only by the books (see the module doc)."""

    id: int
    name: str
    pid: int
    hello: Hello
    kv_min: int
    kv_max: int | None
    admitted_at: float
    lease: int = 0
    want: int = 0
    asked: int = 0
    """What the pool last asked for, before its kv max capped it (a raised max serves it)."""
    usage: Report = NO_USAGE
    reclaim: PendingReclaim | None = None
    charge: int = 0
    waiting_since: float | None = None
    wanted_at: float | None = None
    """When the pool last asked for more (pools say an unmet ask again, see
    :mod:`kvshare.runtime.lease_conversation`)."""
    orphaned_at: float | None = None
    orphan_deadline: float = 0.0
    device_bytes: int | None = None
    over_lease: bool = False
    granted_total: int = 0
    """Bytes ever granted to the pool."""
    sized_for: int = 0
    """The GPU's memory when the pool was first admitted (by this broker or the one before
    it): what its engine sized its KV cache for (0: not known)."""

    @property
    def gpu(self) -> str:
        """UUID of the pool's GPU."""
        return self.hello.gpu

    @property
    def page(self) -> int:
        """The pool's page size: every lease is a multiple of it."""
        return self.hello.page_size

    @property
    def floor(self) -> int:
        """The least the pool is ever taken down to: its minimum, and at least the page
        that holds its null block (which it never releases)."""
        return max(self.kv_min, self.page)

    @property
    def priority(self) -> int:
        """Reclaim priority (lower gives memory back first)."""
        return self.hello.priority

    @property
    def static(self) -> int:
        """Static footprint declared at hello."""
        return self.hello.static

    @property
    def held(self) -> int:
        """Physical bytes the pool last reported holding."""
        return self.usage.held

    def charged_bytes(self) -> int:
        """What the broker charges the pool now: its lease, plus memory it was asked to
        give back and has not yet released (and never less than its kv min). The most the
        pool may hold on the device while a reclaim runs; once the reclaim's deadline has
        passed, memory kept beyond the lease is over-use (see
        :mod:`~kvshare.deviceplugin.broker.audit`). The figure the audit and lease
        enforcement hold the device's own figure against."""
        pending = self.reclaim.from_bytes if self.reclaim is not None else 0
        return max(self.kv_min, self.lease, pending)

    def view(self, now: float) -> PoolView:
        """The pool as plain values."""
        hello = self.hello
        pending = self.reclaim
        return PoolView(
            id=self.id,
            name=self.name,
            gpu=self.gpu,
            pid=self.pid,
            namespace=hello.namespace,
            pod=hello.pod,
            pod_uid=hello.pod_uid,
            modelserver=hello.modelserver,
            rank=hello.rank,
            tp_size=hello.tp_size,
            engine=hello.engine,
            priority=hello.priority,
            page_size=hello.page_size,
            static=hello.static,
            kv_min=self.kv_min,
            kv_max=self.kv_max,
            lease=self.lease,
            charged=self.charged_bytes(),
            want=self.want,
            mapped=self.usage.mapped,
            used=self.usage.used,
            cached=self.usage.cached,
            reserved=self.usage.reserved,
            page_bytes=self.usage.page_bytes,
            layout=self.usage.layout,
            layout_reason=self.usage.layout_reason,
            device_bytes=self.device_bytes,
            over_lease=self.over_lease,
            reclaim_target=pending.target if pending else None,
            reclaim_overdue=bool(pending and pending.overdue),
            orphaned=self.orphaned_at is not None,
            age_s=round(now - self.admitted_at, 3),
            sized_for=self.sized_for,
        )


@dataclass(frozen=True)
class ExpectedPool:
    """A pool the previous broker had admitted, expected to re-declare after a restart."""

    pid: int
    name: str
    gpu: str
    static: int
    kv_min: int
    gpu_total: int = 0
    """The GPU's memory when the pool was admitted: what its engine sized its KV cache
    for (0: not known)."""


@dataclass
class TurnWaiter:
    """An engine queued for its GPU's start-up turn (``key``: its connection)."""

    key: int
    request: TurnRequest
    pid: int
    since: float


@dataclass
class Turn:
    """The start-up turn of one GPU, and the room it reserves for the engine holding it."""

    waiter: TurnWaiter
    granted_at: float
    expires_at: float
    reserved_static: int
    reserved_min: int


@dataclass(eq=False)
class GpuRecord:
    """One GPU: its pools, its start-up turn and the running sums the invariant is kept on."""

    info: GpuInfo
    headroom: int
    pools: dict[int, PoolRecord] = field(default_factory=dict)
    draining: bool = False
    healthy: bool = True
    turn: Turn | None = None
    queue: deque[TurnWaiter] = field(default_factory=deque)
    forming: int = 0
    """Ranks of tensor-parallel groups that wait here for their peers to ask."""
    static_sum: int = 0
    """Static footprints of pools and of the start-up turn's reservation."""
    min_sum: int = 0
    """kv_min of pools and of the start-up turn's reservation."""
    charged: int = 0
    """Charges of pools plus the start-up turn's reserved kv_min."""
    expected_static: int = 0
    expected_min: int = 0
    granted_total: int = 0
    """Bytes ever granted to its pools."""

    @property
    def budget(self) -> int:
        """What the broker may lend: total - headroom - static footprints."""
        return self.info.total_bytes - self.headroom - self.static_sum

    @property
    def unleased(self) -> int:
        """The budget less every charge: what a grant may take. Never negative by the
        broker's own decisions."""
        return self.budget - self.charged

    @property
    def overcommitted(self) -> int:
        """What the pools are charged beyond the budget (0 but after a restart with a
        smaller budget, until the reclaims that follow it are released)."""
        return max(0, self.charged - self.budget)

    @property
    def min_shortfall(self) -> int:
        """What the guaranteed minimums (each pool's floor, and the kv min reserved for an
        engine starting) need beyond the budget: above 0 the budget cannot be reached."""
        floors = sum(p.floor for p in self.pools.values())
        reserved = self.turn.reserved_min if self.turn is not None else 0
        return max(0, floors + reserved - self.budget)

    @property
    def placement_free(self) -> int:
        """Room for the static footprint and kv_min of one more engine."""
        return (
            self.info.total_bytes
            - self.headroom
            - self.static_sum
            - self.min_sum
            - self.expected_static
            - self.expected_min
        )

    def turn_need(self) -> int:
        """Bytes the first queued engine needs before it can get the turn (0: none)."""
        if self.turn is not None or not self.queue:
            return 0
        head = self.queue[0].request
        return head.static + head.kv_min

    def may_grow_to(self, pool: PoolRecord) -> int:
        """The most a grant may give ``pool`` now: its kv max (unbounded: the budget), or
        its floor on a GPU that is draining or unhealthy; never below its floor."""
        if self.draining or not self.healthy:
            return pool.floor
        if pool.kv_max is None:
            return max(self.budget, pool.floor)
        return max(pool.kv_max, pool.floor)

    def cap(self, pool: PoolRecord) -> int:
        """What the pool asks to grow to now: its want (kept within its kv max when it is
        set), or at most its floor on a GPU that is draining or unhealthy."""
        if self.draining or not self.healthy:
            return min(pool.want, pool.floor)
        return pool.want

    def pool_state(self, p: PoolRecord) -> PoolState:
        """One of its pools as the policy sees it."""
        return PoolState(
            id=p.id,
            priority=p.priority,
            page=p.page,
            floor=p.floor,
            kv_max=p.kv_max,
            want=p.want,
            cap=self.cap(p),
            lease=p.lease,
            charge=p.charge,
            held=p.held,
            used=p.usage.used,
            cached=p.usage.cached,
            waiting_since=p.waiting_since,
            wanted_at=p.wanted_at,
            reclaim_target=p.reclaim.target if p.reclaim else None,
            reclaim_overdue=bool(p.reclaim and p.reclaim.overdue),
        )

    def snapshot(self, now: float) -> GpuState:
        """The GPU as the policy sees it."""
        pools = tuple(self.pool_state(p) for p in self.pools.values())
        return GpuState(
            now=now,
            budget=self.budget,
            unleased=self.unleased,
            turn_need=self.turn_need(),
            reserved=self.charged - sum(p.charge for p in self.pools.values()),
            draining=self.draining,
            pools=pools,
        )

    def view(self) -> GpuView:
        """The GPU's budget and usage as plain values."""
        pools = self.pools.values()
        turn = self.turn
        return GpuView(
            uuid=self.info.uuid,
            index=self.info.index,
            name=self.info.name,
            total=self.info.total_bytes,
            headroom=self.headroom,
            healthy=self.healthy,
            draining=self.draining,
            static=self.static_sum,
            kv_min=self.min_sum,
            kv_lease=sum(p.lease for p in pools),
            kv_charged=self.charged,
            kv_mapped=sum(p.usage.mapped for p in pools),
            kv_used=sum(p.usage.used for p in pools),
            free=self.placement_free,
            unleased=self.unleased,
            overcommitted=self.overcommitted,
            min_shortfall=self.min_shortfall,
            pools_sized_larger=sum(1 for p in pools if p.sized_for > self.info.total_bytes),
            pools=len(self.pools),
            turn_holder=f"pid {turn.waiter.pid}" if turn else "",
            turn_waiting=len(self.queue) + self.forming,
        )
