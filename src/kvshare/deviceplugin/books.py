"""The broker's books: per-GPU budgets, pool leases, reclaims and start-up turns.

Pure bookkeeping, no sockets and no clock of its own: every operation takes the current
(monotonic) time and returns the messages to send as a list of :class:`Send`. The
server (:mod:`kvshare.deviceplugin.broker`) owns the sockets and calls in under its lock.

Accounting, per GPU
-------------------
- ``budget = total - headroom - static`` where ``static`` sums the static footprints of
  the pools on the GPU and of the engine holding the start-up turn.
- Each pool is *charged* ``max(kv_min, lease, what it may still hold of a reclaim)``:
  its minimum is always set aside, and memory being reclaimed stays charged to it until
  it reports, with the reclaim in force, that it released it (all at once or page by
  page: what such a report shows given back is free at once). (Holding more than the
  lease is over-use, caught by the audit against the device, not something a report can
  claim.)
- ``unleased = budget - sum(charged) - kv_min reserved by the start-up turn``.

Invariant: a grant never makes ``unleased`` negative, so the GPU is never physically
over-committed by the broker's own decisions. (Re-declarations after a restart are taken
as the truth even when they exceed the budget; the books then reclaim back within it.)

Policy
------
- Admission guarantees ``kv_min``: a pool is admitted only when ``static + kv_min`` fits
  in ``total - headroom - static - kv_min`` of the pools already there; otherwise it is
  refused with the numbers.
- Growth is granted on demand from unleased memory, page-aligned, up to ``kv_max``.
- Fair shares are a weighted max-min split of the budget (weight ``priority + 1``, each
  pool between its *floor* — ``kv_min``, and at least the page that holds its null block,
  which a pool never releases — and its demand: what it uses, or what it asks for while it
  waits). A pool below its fair share that cannot grow makes the broker reclaim, in one
  round, everything it and the other waiters are short of:

  1. *idle lease* first: lease above what a pool that is not waiting holds or uses. The
     pool gives it back at once (it only lowers its limit and drops ready pages), so the
     waiter gets it within a round trip;
  2. then memory held above a fair share, lowest priority first, each pool down to no
     less than its fair share and its floor. Blocks in use count: the pool stops
     placing new blocks in the pages it gives up and releases them as their requests
     finish (the runtime's pool does), so a pool with a backlog cannot keep more than its
     share.

  A pool that is still releasing an earlier reclaim can be asked for more when the
  waiters need more (the reclaim is re-issued with a lower target); otherwise it would
  go on filling the rest of its lease until it had released the first. Each reclaim has
  a deadline. A pool that misses it is reported (event and log) and skipped for further
  reclaims; its memory stays charged to it until it does release.
- Start-up turns: one engine per GPU at a time; the turn reserves the engine's static
  footprint and ``kv_min`` (reclaiming if needed) before it is granted, and the pool the
  engine then creates takes over that reservation.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvshare.api.quantity import format_bytes_human
from kvshare.api.wire import (
    PROTOCOL_VERSION,
    Hello,
    Lease,
    Message,
    Reclaim,
    Report,
    TurnGranted,
    TurnRefused,
    TurnRequest,
)
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.deviceplugin.views import BooksView, GpuView, PoolView

__all__ = [
    "Admission",
    "Books",
    "BrokerEvents",
    "ExpectedPool",
    "PoolRecord",
    "Send",
]

log = logging.getLogger(__name__)

MAX_PRIORITY = 1000
_NO_USAGE = Report(mapped=0, used=0, cached=0, reserved=0)

# Reasons a Lease reply gives; the part before ':' is the denial label in metrics.
GRANTED = "granted"
PARTIAL = "partial: reclaiming from other pools"
WAITING = "waiting: reclaiming from other pools"
FULL = "full: no unleased memory and this pool is at its fair share"
AT_MAX = "max: the lease is at the pool's kv max"
RECOVERING = "recovering: the broker is rebuilding its books after a restart"
DRAINING = "draining: this GPU is being drained to each pool's minimum"
RECLAIMING = "reclaiming: this pool has an unacknowledged reclaim"
UNHEALTHY = "unhealthy: this GPU is reported unhealthy"


def _align_up(value: int, page: int) -> int:
    return -(-value // page) * page


def _align_down(value: int, page: int) -> int:
    return value // page * page


def _size(value: int) -> str:
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

    def admitted(self, gpu: str, resumed: bool) -> None:
        """A pool was admitted (``resumed``: re-declared after a reconnect)."""

    def refused(self, gpu: str, reason: str) -> None:
        """A pool was refused admission."""

    def removed(self, gpu: str, why: str) -> None:
        """A pool left (``bye``, ``connection closed``, ``process exited``, ...)."""

    def protocol_error(self, kind: str) -> None:
        """A connection broke the protocol (a :class:`~kvshare.api.wire.ProtocolError`
        of ``kind``) and was closed."""


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


@dataclass(eq=False)
class PoolRecord:
    """One admitted pool. Mutated only by :class:`Books`."""

    id: int
    name: str
    pid: int
    hello: Hello
    kv_min: int
    kv_max: int | None
    admitted_at: float
    lease: int = 0
    want: int = 0
    usage: Report = _NO_USAGE
    reclaim: PendingReclaim | None = None
    charge: int = 0
    waiting_since: float | None = None
    orphaned_at: float | None = None
    orphan_deadline: float = 0.0
    device_bytes: int | None = None
    over_lease: bool = False

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


@dataclass(frozen=True)
class ExpectedPool:
    """A pool the previous broker had admitted, expected to re-declare after a restart."""

    pid: int
    name: str
    gpu: str
    static: int
    kv_min: int


@dataclass
class _TurnWaiter:
    key: int
    request: TurnRequest
    pid: int
    since: float


@dataclass
class _Turn:
    waiter: _TurnWaiter
    granted_at: float
    expires_at: float
    reserved_static: int
    reserved_min: int


@dataclass(eq=False)
class _Gpu:
    info: GpuInfo
    headroom: int
    pools: dict[int, PoolRecord] = field(default_factory=dict)
    draining: bool = False
    healthy: bool = True
    turn: _Turn | None = None
    queue: deque[_TurnWaiter] = field(default_factory=deque)
    static_sum: int = 0
    """Static footprints of pools and of the start-up turn's reservation."""
    min_sum: int = 0
    """kv_min of pools and of the start-up turn's reservation."""
    charged: int = 0
    """Charges of pools plus the start-up turn's reserved kv_min."""
    expected_static: int = 0
    expected_min: int = 0

    @property
    def budget(self) -> int:
        return self.info.total_bytes - self.headroom - self.static_sum

    @property
    def unleased(self) -> int:
        return self.budget - self.charged

    @property
    def placement_free(self) -> int:
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


@dataclass(frozen=True)
class Admission:
    """The outcome of a Hello: the pool's record, or why it was refused."""

    record: PoolRecord | None
    reason: str
    sends: list[Send]


def fair_shares(capacity: int, pools: Iterable[tuple[int, int, int, int]]) -> dict[int, int]:
    """Weighted max-min fair split of ``capacity`` bytes.

    ``pools`` yields ``(id, floor, demand, weight)``. Each pool gets at least its floor,
    never more than its demand (when demand >= floor), and what is left is divided in
    proportion to the weights, re-dividing what capped pools leave over.
    """
    entries = list(pools)
    share = {pid: floor for pid, floor, _, _ in entries}
    remaining = capacity - sum(share.values())
    active = [(pid, demand, weight) for pid, floor, demand, weight in entries if demand > floor]
    while remaining > 0 and active:
        total_weight = sum(weight for _, _, weight in active)
        capped = [
            (pid, demand)
            for pid, demand, weight in active
            if share[pid] + remaining * weight // total_weight >= demand
        ]
        if not capped:
            for pid, _, weight in active:
                share[pid] += remaining * weight // total_weight
            break
        for pid, demand in capped:
            remaining -= demand - share[pid]
            share[pid] = demand
        done = {pid for pid, _ in capped}
        active = [entry for entry in active if entry[0] not in done]
    return share


class Books:
    """Leases, reclaims and start-up turns of every GPU on the node.

    Not thread-safe: the broker calls it under one lock (see ``Broker._lock``).
    """

    def __init__(
        self,
        gpus: Iterable[GpuInfo],
        *,
        headroom: int,
        reclaim_deadline_s: float = 10.0,
        turn_hold_s: float = 600.0,
        orphan_grace_s: float = 0.5,
        orphan_wait_s: float = 10.0,
        events: BrokerEvents | None = None,
        expected: Iterable[ExpectedPool] = (),
        recovery_deadline: float | None = None,
    ) -> None:
        self._gpus = {gpu.uuid: _Gpu(info=gpu, headroom=headroom) for gpu in gpus}
        for gpu in self._gpus.values():
            gpu.healthy = gpu.info.healthy
            if gpu.info.total_bytes <= headroom:
                raise ValueError(
                    f"headroom {_size(headroom)} leaves nothing of GPU {gpu.info.index} "
                    f"({_size(gpu.info.total_bytes)}): lower --headroom"
                )
        self._pools: dict[int, PoolRecord] = {}
        self._reclaim_deadline_s = reclaim_deadline_s
        self._turn_hold_s = turn_hold_s
        self._orphan_grace_s = orphan_grace_s
        self._orphan_wait_s = orphan_wait_s
        self._events = events or BrokerEvents()
        self._next_pool_id = 1
        self._next_seq = 1
        self._expected: dict[int, ExpectedPool] = {}
        for pool in expected:
            home = self._gpus.get(pool.gpu)
            if home is None:
                log.warning(
                    "pool %s was on unknown GPU %s: not waiting for it", pool.name, pool.gpu
                )
                continue
            self._expected[pool.pid] = pool
            home.expected_static += pool.static
            home.expected_min += pool.kv_min
        self._recovery_deadline = recovery_deadline if self._expected else None

    # --- queries ------------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether pools of the previous broker are still expected to re-declare."""
        return self._recovery_deadline is not None

    def pool(self, pool_id: int) -> PoolRecord | None:
        """The record of an admitted pool."""
        return self._pools.get(pool_id)

    def pools(self) -> list[PoolRecord]:
        """Every admitted pool."""
        return list(self._pools.values())

    def gpu_uuids(self) -> list[str]:
        """UUIDs of the GPUs, in index order."""
        return [g.info.uuid for g in sorted(self._gpus.values(), key=lambda g: g.info.index)]

    def find(self, selector: str) -> list[PoolRecord]:
        """Pools whose id or name is ``selector`` (names may repeat across GPUs)."""
        if selector.isdigit():
            record = self._pools.get(int(selector))
            return [record] if record else []
        return [p for p in self._pools.values() if p.name == selector]

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`tick` has something to do."""
        times: list[float] = []
        for pool in self._pools.values():
            if pool.reclaim is not None and not pool.reclaim.overdue:
                times.append(pool.reclaim.deadline)
            if pool.orphaned_at is not None:
                times.append(pool.orphan_deadline)
        for gpu in self._gpus.values():
            if gpu.turn is not None:
                times.append(gpu.turn.expires_at)
        if self._recovery_deadline is not None:
            times.append(self._recovery_deadline)
        return min(times) if times else None

    # --- admission ----------------------------------------------------------------------

    def admit(self, hello: Hello, pid: int, now: float) -> Admission:
        """Admit the pool saying ``hello`` from process ``pid``, or refuse it."""
        gpu = self._gpus.get(hello.gpu)
        problem = self._hello_problem(hello, gpu)
        if problem is not None or gpu is None:
            reason = problem or "unknown GPU"
            self._events.refused(hello.gpu, reason.split(":", 1)[0])
            return Admission(None, reason, [])
        if hello.resume:
            return self._resume(gpu, hello, pid, now)
        return self._admit_new(gpu, hello, pid, now)

    def _admit_new(self, gpu: _Gpu, hello: Hello, pid: int, now: float) -> Admission:
        turn = self._matching_turn(gpu, hello, pid)
        # An engine that got its start-up turn before a drain or a health change has its
        # room reserved: it may finish starting.
        if turn is None and (gpu.draining or not gpu.healthy):
            state = "draining" if gpu.draining else "unhealthy"
            reason = f"GPU {gpu.info.index} ({gpu.info.uuid}) is {state}: it takes no new pools"
            self._events.refused(hello.gpu, state)
            return Admission(None, reason, [])
        credit = turn.reserved_static + turn.reserved_min if turn else 0
        kv_min = _align_up(hello.kv_min, hello.page_size)
        if hello.static + kv_min > gpu.placement_free + credit:
            reason = self._no_fit(gpu, hello.static, kv_min)
            self._events.refused(hello.gpu, "fit")
            return Admission(None, reason, [])
        if turn is not None:
            self._consume_reservation(gpu, turn)
        record = self._add(gpu, hello, pid, now, lease=0)
        record.want = record.kv_min
        self._grant(gpu, record, record.kv_min, holdback=0)
        if record.lease < record.want:
            record.waiting_since = now
        sends = self._rebalance(gpu, now)
        self._events.admitted(hello.gpu, resumed=False)
        log.info(
            "admitted pool %s (pid %d) on GPU %d: static %s, kv min %s, max %s, priority %d",
            record.name,
            pid,
            gpu.info.index,
            _size(hello.static),
            _size(record.kv_min),
            "none" if record.kv_max is None else _size(record.kv_max),
            hello.priority,
        )
        return Admission(record, "", sends)

    def _hello_problem(self, hello: Hello, gpu: _Gpu | None) -> str | None:
        if hello.version != PROTOCOL_VERSION:
            return (
                f"version: protocol version {hello.version} is not supported (this broker "
                f"speaks {PROTOCOL_VERSION}); run matching kvshare versions"
            )
        if gpu is None:
            known = ", ".join(self.gpu_uuids())
            return (
                f"gpu: unknown GPU {hello.gpu!r}; this node has {known} "
                "(KVSHARE_GPU_UUIDS must name GPUs of this node)"
            )
        if hello.page_size <= 0 or hello.page_size % 4096:
            return f"policy: page size {hello.page_size} is not a positive multiple of 4096"
        if min(hello.kv_min, hello.static, hello.held, hello.used, hello.lease, hello.rank) < 0:
            return "policy: sizes and rank must be >= 0"
        if hello.tp_size < 1:
            return "policy: tensor-parallel size must be >= 1"
        if hello.kv_max is not None and hello.kv_max < hello.kv_min:
            return f"policy: kv max {_size(hello.kv_max)} is below kv min {_size(hello.kv_min)}"
        if not 0 <= hello.priority <= MAX_PRIORITY:
            return f"policy: priority {hello.priority} is outside 0-{MAX_PRIORITY}"
        return None

    def _no_fit(self, gpu: _Gpu, static: int, kv_min: int) -> str:
        others = len(gpu.pools)
        return (
            f"fit: static {_size(static)} + kv min {_size(kv_min)} does not fit on GPU "
            f"{gpu.info.index} ({gpu.info.uuid}): {_size(max(gpu.placement_free, 0))} left "
            f"of {_size(gpu.info.total_bytes)} (headroom {_size(gpu.headroom)}, static "
            f"{_size(gpu.static_sum + gpu.expected_static)} and kv min "
            f"{_size(gpu.min_sum + gpu.expected_min)} committed to {others} pool(s)); "
            "lower kvCache.min or place the model on another GPU"
        )

    def _resume(self, gpu: _Gpu, hello: Hello, pid: int, now: float) -> Admission:
        """A pool that holds memory reconnects: its declaration is the truth."""
        sends: list[Send] = []
        existing = next(
            (
                p
                for p in gpu.pools.values()
                if p.pid == pid and p.hello.pod == hello.pod and p.hello.rank == hello.rank
            ),
            None,
        )
        if existing is not None:
            # The connection dropped while this broker kept the books: they stay
            # authoritative; an unacknowledged reclaim is sent again.
            existing.orphaned_at = None
            if existing.reclaim is not None:
                sends.append(self._reclaim(gpu, existing, existing.reclaim.target, now, "resent"))
            log.info("pool %s (pid %d) reconnected", existing.name, pid)
            self._events.admitted(hello.gpu, resumed=True)
            return Admission(existing, "", sends)
        expected = self._expected.pop(pid, None)
        if expected is None:
            return self._resume_unknown(gpu, hello, pid, now)
        home = self._gpus.get(expected.gpu)
        if home is not None:
            home.expected_static -= expected.static
            home.expected_min -= expected.kv_min
        lease = _align_up(max(hello.lease, hello.held), hello.page_size)
        record = self._add(gpu, hello, pid, now, lease=lease)
        record.usage = Report(mapped=hello.held, used=hello.used, cached=0, reserved=0)
        record.want = lease
        self._recharge(gpu, record)
        if gpu.unleased < 0:
            log.warning(
                "GPU %d is over-committed by %s after pool %s re-declared %s: reclaiming",
                gpu.info.index,
                _size(-gpu.unleased),
                record.name,
                _size(lease),
            )
        log.info(
            "pool %s (pid %d) re-declared lease %s, holding %s",
            record.name,
            pid,
            _size(lease),
            _size(hello.held),
        )
        self._events.admitted(hello.gpu, resumed=True)
        if self.recovering:
            sends += self._finish_recovery_if_done(now)
        else:
            sends += self._rebalance(gpu, now)
        return Admission(record, "", sends)

    def _resume_unknown(self, gpu: _Gpu, hello: Hello, pid: int, now: float) -> Admission:
        """A process this broker neither knows nor expects claims to hold memory.

        It is admitted like a new pool and gets what it declares only from unleased
        memory; whatever it holds beyond that it is asked to give back. Other pools'
        leases are never touched for it.
        """
        admission = self._admit_new(gpu, hello, pid, now)
        record = admission.record
        if record is None:
            return admission
        sends = list(admission.sends)
        declared = _align_up(max(hello.lease, hello.held), hello.page_size)
        if record.kv_max is not None:
            declared = min(declared, record.kv_max)
        if declared > record.lease:
            record.want = declared
            self._grant(gpu, record, declared, holdback=gpu.turn_need())
        if hello.held > record.lease:
            log.warning(
                "pool %s (pid %d) re-declared %s unknown to this broker: granted %s from "
                "unleased memory and asked it to shrink to that",
                record.name,
                pid,
                _size(hello.held),
                _size(record.lease),
            )
            sends.append(self._reclaim(gpu, record, record.lease, now, "unknown re-declaration"))
        return Admission(record, "", sends)

    def _add(self, gpu: _Gpu, hello: Hello, pid: int, now: float, lease: int) -> PoolRecord:
        base = f"{hello.namespace}/{hello.pod}" if hello.pod else f"pid-{pid}"
        if hello.tp_size > 1 or hello.rank:
            base += f"/rank{hello.rank}"
        pool_id = self._next_pool_id
        self._next_pool_id += 1
        name = base
        if any(p.name == base and p.gpu == hello.gpu for p in self._pools.values()):
            name = f"{base}~{pool_id}"
        kv_min = _align_up(hello.kv_min, hello.page_size)
        kv_max = None if hello.kv_max is None else _align_down(hello.kv_max, hello.page_size)
        if kv_max is not None:
            kv_max = max(kv_max, kv_min)
        record = PoolRecord(
            id=pool_id,
            name=name,
            pid=pid,
            hello=hello,
            kv_min=kv_min,
            kv_max=kv_max,
            admitted_at=now,
            lease=lease,
        )
        self._pools[pool_id] = record
        gpu.pools[pool_id] = record
        gpu.static_sum += hello.static
        gpu.min_sum += kv_min
        self._recharge(gpu, record)
        return record

    @staticmethod
    def _matching_turn(gpu: _Gpu, hello: Hello, pid: int) -> _Turn | None:
        """The start-up turn held by the engine that is now creating this pool, if any."""
        turn = gpu.turn
        if turn is None or not (turn.reserved_static or turn.reserved_min):
            return None
        request = turn.waiter.request
        same_process = turn.waiter.pid == pid
        same_worker = bool(request.pod_uid) and (
            request.pod_uid == hello.pod_uid and request.rank == hello.rank
        )
        return turn if same_process or same_worker else None

    @staticmethod
    def _consume_reservation(gpu: _Gpu, turn: _Turn) -> None:
        """The pool's own static and kv_min replace what the turn reserved for it."""
        gpu.static_sum -= turn.reserved_static
        gpu.min_sum -= turn.reserved_min
        gpu.charged -= turn.reserved_min
        turn.reserved_static = turn.reserved_min = 0

    # --- leases -------------------------------------------------------------------------

    def want(self, pool_id: int, seq: int, total: int, now: float) -> list[Send]:
        """Pool ``pool_id`` asks for its lease to reach ``total``; always answers ``seq``."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        asked = _align_up(max(total, 0), pool.page)
        at_max = pool.kv_max is not None and asked > pool.kv_max
        if pool.kv_max is not None:
            asked = min(asked, pool.kv_max)
        pool.want = max(asked, pool.floor)
        target = self._cap(gpu, pool)
        reason: str | None = None
        if pool.reclaim is not None:
            reason = RECLAIMING
        elif self.recovering:
            reason = RECOVERING
        elif target <= pool.lease:
            if asked <= pool.lease:
                reason = AT_MAX if at_max else GRANTED
            else:
                reason = DRAINING if gpu.draining else UNHEALTHY
        if reason is not None:
            if asked > pool.lease:
                pool.waiting_since = pool.waiting_since or now
                self._events.denied(pool.gpu, reason.split(":", 1)[0])
            return [Send("pool", pool_id, Lease(seq=seq, limit=pool.lease, reason=reason))]
        pool.waiting_since = pool.waiting_since or now
        granted = self._grant(gpu, pool, target, holdback=gpu.turn_need())
        sends: list[Send] = []
        if pool.lease >= target:
            pool.waiting_since = None
            reason = AT_MAX if at_max else GRANTED
        else:
            sends = self._rebalance(gpu, now)
            reclaiming = any(p.reclaim and not p.reclaim.overdue for p in gpu.pools.values())
            reason = (PARTIAL if granted else WAITING) if reclaiming else FULL
            if not granted:
                self._events.denied(pool.gpu, reason.split(":", 1)[0])
        return [Send("pool", pool_id, Lease(seq=seq, limit=pool.lease, reason=reason)), *sends]

    @staticmethod
    def _cap(gpu: _Gpu, pool: PoolRecord) -> int:
        """What the pool may grow to now: its want, or its minimum on a GPU that is
        draining or unhealthy."""
        if gpu.draining or not gpu.healthy:
            return min(pool.want, pool.floor)
        return pool.want

    def _waiting(self, gpu: _Gpu) -> list[PoolRecord]:
        return [p for p in gpu.pools.values() if p.reclaim is None and self._cap(gpu, p) > p.lease]

    def _grant(self, gpu: _Gpu, pool: PoolRecord, target: int, holdback: int) -> int:
        """Grow ``pool`` toward ``target`` from unleased memory; returns bytes granted."""
        room = gpu.unleased - holdback + (pool.charge - pool.lease)
        step = _align_down(min(target - pool.lease, room), pool.page)
        if step <= 0:
            return 0
        pool.lease += step
        self._recharge(gpu, pool)
        self._events.granted(pool.gpu, step)
        return step

    def report(self, pool_id: int, report: Report, now: float) -> list[Send]:
        """Pool ``pool_id`` reports what it holds (and maybe acknowledges a reclaim)."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        pool.usage = report
        pending = pool.reclaim
        in_force = pending is not None and report.ack == pending.seq
        acknowledged = in_force and pending is not None and report.held <= pending.target
        released = (
            in_force
            and pending is not None
            and not acknowledged
            and _align_up(report.held, pool.page) < pending.from_bytes
        )
        if released and pending is not None:
            # The pool no longer grows beyond what it reports: the rest is free already.
            pending.from_bytes = _align_up(report.held, pool.page)
        if acknowledged and pending is not None:
            pool.reclaim = None
            seconds = now - pending.issued_at
            self._events.reclaim_completed(pool.gpu, seconds)
            if pending.overdue:
                log.warning(
                    "pool %s released its memory %.1f s after the reclaim (deadline was %.1f s)",
                    pool.name,
                    seconds,
                    self._reclaim_deadline_s,
                )
        self._recharge(gpu, pool)
        if acknowledged or released:
            return self._serve(gpu, now)
        # A pending reclaim stands even when blocks are in use above its target: the pool
        # releases them as their requests finish (see the module doc).
        if not self.recovering and self._waiting(gpu):
            # Usage moved: what other pools may be asked to give back moved with it.
            return self._rebalance(gpu, now)
        return []

    def remove(self, pool_id: int, why: str, now: float) -> list[Send]:
        """Pool ``pool_id`` is gone (``why``: bye, closed, exited, ...): its lease returns."""
        pool = self._pools.pop(pool_id, None)
        if pool is None:
            return []
        gpu = self._gpus[pool.gpu]
        del gpu.pools[pool_id]
        gpu.static_sum -= pool.static
        gpu.min_sum -= pool.kv_min
        gpu.charged -= pool.charge
        self._events.removed(pool.gpu, why)
        log.info(
            "pool %s (pid %d) left (%s): %s returned to GPU %d",
            pool.name,
            pool.pid,
            why,
            _size(pool.charge),
            gpu.info.index,
        )
        return self._serve(gpu, now)

    def orphan(self, pool_id: int, now: float, *, watched: bool) -> None:
        """The pool's connection closed without a goodbye. It is removed when its process
        exits (the broker calls :meth:`remove`), or when it has not reconnected within
        ``orphan_wait_s`` (``orphan_grace_s`` if its process is not ``watched``)."""
        pool = self._pools.get(pool_id)
        if pool is not None and pool.orphaned_at is None:
            pool.orphaned_at = now
            pool.orphan_deadline = now + (self._orphan_wait_s if watched else self._orphan_grace_s)

    def _recharge(self, gpu: _Gpu, pool: PoolRecord) -> None:
        # What a pool reports holding beyond its lease is not charged: reports are the
        # pool's word, and a pool must not be able to push others out by inflating it.
        # Real over-use is caught by the audit against the device.
        pending = pool.reclaim.from_bytes if pool.reclaim is not None else 0
        charge = max(pool.kv_min, pool.lease, pending)
        gpu.charged += charge - pool.charge
        pool.charge = charge

    # --- serving waiters and reclaiming -------------------------------------------------

    def _fair(self, gpu: _Gpu) -> dict[int, int]:
        if gpu.draining:
            return {p.id: p.floor for p in gpu.pools.values()}
        capacity = gpu.budget - gpu.turn_need() - (gpu.charged - self._pool_charges(gpu))
        entries = []
        for p in gpu.pools.values():
            # Demand is what the pool uses, or what it asks for while it waits; leases it
            # does not use (and prefix cache it could evict) do not count.
            waiting = p.want if p.want > p.lease else 0
            demand = max(p.floor, p.usage.used, waiting)
            if p.kv_max is not None:
                demand = min(demand, max(p.kv_max, p.floor))
            entries.append((p.id, p.floor, demand, p.priority + 1))
        return fair_shares(capacity, entries)

    @staticmethod
    def _pool_charges(gpu: _Gpu) -> int:
        return sum(p.charge for p in gpu.pools.values())

    def _serve(self, gpu: _Gpu, now: float) -> list[Send]:
        """Hand unleased memory to the start-up turn first, then to waiting pools (those
        below their fair share first), then reclaim for whoever still waits."""
        if self.recovering:
            return []
        sends = self._advance_turn(gpu, now)
        waiters = self._waiting(gpu)
        if waiters:
            fair = self._fair(gpu)
            holdback = gpu.turn_need()
            order = sorted(
                waiters,
                key=lambda p: (p.lease >= fair[p.id], -p.priority, p.waiting_since or now, p.id),
            )
            grown: dict[int, PoolRecord] = {}
            for capped in (True, False):
                for pool in order:
                    target = self._cap(gpu, pool)
                    if capped:
                        target = min(target, max(fair[pool.id], pool.lease))
                    if target > pool.lease and self._grant(gpu, pool, target, holdback):
                        grown[pool.id] = pool
            for pool in grown.values():
                if pool.lease >= self._cap(gpu, pool):
                    pool.waiting_since = None
                sends.append(Send("pool", pool.id, Lease(seq=0, limit=pool.lease, reason=GRANTED)))
        return sends + self._rebalance(gpu, now)

    def _rebalance(self, gpu: _Gpu, now: float) -> list[Send]:
        """Issue the reclaims needed for waiters below their fair share, a waiting
        start-up turn, or an over-committed GPU: all of it in one round, idle lease first
        (see the module doc)."""
        if self.recovering:
            return []
        fair = self._fair(gpu)
        waiters = self._waiting(gpu)
        shortfall = gpu.turn_need()
        for pool in waiters:
            entitled = min(self._cap(gpu, pool), max(fair[pool.id], pool.floor))
            shortfall += max(0, entitled - pool.lease)
        incoming = 0
        for pool in gpu.pools.values():
            pending = pool.reclaim
            if pending is not None and not pending.overdue:
                incoming += max(0, pool.charge - max(pool.floor, pending.target))
        # Idle lease is taken for everything the waiters are short of, even what pending
        # reclaims will bring: it costs its holder nothing and comes back at once, while
        # memory in use comes back only as its requests finish.
        idle_need = shortfall - gpu.unleased
        need = idle_need - incoming
        if idle_need <= 0:
            return []
        # Never below a pool's fair share or its floor. Pools still releasing a reclaim can
        # be asked for more; those past its deadline are left alone (see the module doc).
        floors = {p.id: _align_up(max(fair[p.id], p.floor), p.page) for p in gpu.pools.values()}
        victims = sorted(
            (
                p
                for p in gpu.pools.values()
                if (p.reclaim is None or not p.reclaim.overdue) and p.lease > floors[p.id]
            ),
            key=lambda p: (p.priority, -(p.held - p.usage.used), -(p.lease - floors[p.id]), p.id),
        )
        waiting = {p.id for p in waiters}
        targets = {p.id: p.lease for p in victims}
        # Pass 1, idle lease: what pools that are not waiting neither hold nor use.
        for victim in victims:
            if idle_need <= 0:
                break
            if victim.id in waiting:
                continue
            keep = max(
                floors[victim.id], _align_up(max(victim.held, victim.usage.used), victim.page)
            )
            take = min(targets[victim.id] - keep, _align_up(idle_need, victim.page))
            if take > 0:
                targets[victim.id] -= take
                idle_need -= take
                need -= take
        # Pass 2, memory held above a fair share (blocks in use included).
        for victim in victims:
            if need <= 0:
                break
            take = min(targets[victim.id] - floors[victim.id], _align_up(need, victim.page))
            if take > 0:
                targets[victim.id] -= take
                need -= take
        reason = "draining" if gpu.draining else "contention"
        return [
            self._reclaim(gpu, victim, targets[victim.id], now, reason)
            for victim in victims
            if targets[victim.id] < victim.lease
        ]

    def _reclaim(
        self,
        gpu: _Gpu,
        pool: PoolRecord,
        target: int,
        now: float,
        reason: str,
        *,
        deadline: float | None = None,
    ) -> Send:
        seq = self._next_seq
        self._next_seq += 1
        previous = pool.reclaim
        pool.reclaim = PendingReclaim(
            seq=seq,
            target=target,
            from_bytes=previous.from_bytes if previous else pool.lease,
            issued_at=previous.issued_at if previous else now,
            deadline=deadline if deadline is not None else now + self._reclaim_deadline_s,
        )
        pool.lease = target
        # The pool asks again if it still needs more; until then it is not waiting.
        pool.want = min(pool.want, target)
        pool.waiting_since = None
        self._recharge(gpu, pool)
        self._events.reclaim_issued(pool.gpu)
        log.debug("reclaim %d: pool %s down to %s (%s)", seq, pool.name, _size(target), reason)
        left = max(pool.reclaim.deadline - now, 0.0)
        return Send("pool", pool.id, Reclaim(seq=seq, limit=target, deadline_s=left, reason=reason))

    # --- timers -------------------------------------------------------------------------

    def tick(self, now: float) -> tuple[list[Send], list[int]]:
        """Act on deadlines that have passed. Returns messages to send and the ids of
        orphaned pools removed (their connections are already gone)."""
        sends: list[Send] = []
        removed: list[int] = []
        for pool in list(self._pools.values()):
            gpu = self._gpus[pool.gpu]
            if pool.orphaned_at is not None and now >= pool.orphan_deadline:
                removed.append(pool.id)
                sends += self.remove(pool.id, "connection closed", now)
                continue
            pending = pool.reclaim
            if pending is not None and not pending.overdue and now >= pending.deadline:
                pending.overdue = True
                self._events.reclaim_overdue(pool)
                log.warning(
                    "pool %s (pid %d) missed its reclaim deadline: asked down to %s %.1f s ago, "
                    "still charged %s (holds %s); its memory stays with it",
                    pool.name,
                    pool.pid,
                    _size(pending.target),
                    now - pending.issued_at,
                    _size(pool.charge),
                    _size(pool.held),
                )
                sends += self._rebalance(gpu, now)
        for gpu in self._gpus.values():
            turn = gpu.turn
            if turn is not None and now >= turn.expires_at:
                log.warning(
                    "start-up turn on GPU %d held for %.0f s by pid %d: taking it back",
                    gpu.info.index,
                    now - turn.granted_at,
                    turn.waiter.pid,
                )
                sends += self._release_turn(gpu, now)
        if self._recovery_deadline is not None and now >= self._recovery_deadline:
            sends += self._finish_recovery(now)
        return sends, removed

    # --- recovery after a broker restart ------------------------------------------------

    def forget_expected(self, pid: int, now: float) -> list[Send]:
        """An expected pool's process is gone: stop waiting for it."""
        pool = self._expected.pop(pid, None)
        if pool is None:
            return []
        gpu = self._gpus.get(pool.gpu)
        if gpu is not None:
            gpu.expected_static -= pool.static
            gpu.expected_min -= pool.kv_min
        log.info("pool %s of the previous broker is gone (pid %d exited)", pool.name, pid)
        return self._finish_recovery_if_done(now)

    def _finish_recovery_if_done(self, now: float) -> list[Send]:
        return self._finish_recovery(now) if not self._expected else []

    def _finish_recovery(self, now: float) -> list[Send]:
        if self._recovery_deadline is None:
            return []
        for pool in self._expected.values():
            log.warning(
                "pool %s (pid %d) did not re-declare after the broker restart; "
                "no longer reserving for it",
                pool.name,
                pool.pid,
            )
            gpu = self._gpus.get(pool.gpu)
            if gpu is not None:
                gpu.expected_static -= pool.static
                gpu.expected_min -= pool.kv_min
        self._expected.clear()
        self._recovery_deadline = None
        log.info("books rebuilt: %d pool(s) re-declared", len(self._pools))
        sends: list[Send] = []
        for gpu in self._gpus.values():
            sends += self._serve(gpu, now)
        return sends

    # --- start-up turns -----------------------------------------------------------------

    def turn_request(self, key: int, request: TurnRequest, pid: int, now: float) -> list[Send]:
        """Queue connection ``key`` for the start-up turn of ``request.gpu``."""
        gpu = self._gpus.get(request.gpu)
        refusal: str | None = None
        if gpu is None:
            refusal = f"unknown GPU {request.gpu!r}; this node has {', '.join(self.gpu_uuids())}"
        elif gpu.draining or not gpu.healthy:
            state = "draining" if gpu.draining else "unhealthy"
            refusal = f"GPU {gpu.info.index} is {state}: it takes no new engines"
        elif min(request.static, request.kv_min) < 0:
            refusal = "static and kv min must be >= 0"
        elif request.static + request.kv_min > gpu.placement_free:
            refusal = self._no_fit(gpu, request.static, request.kv_min)
        if refusal is not None or gpu is None:
            return [Send("turn", key, TurnRefused(seq=request.seq, reason=refusal or ""))]
        gpu.queue.append(_TurnWaiter(key=key, request=request, pid=pid, since=now))
        return self._serve(gpu, now)

    def turn_done(self, key: int, now: float) -> list[Send]:
        """Connection ``key`` is done with (or gave up waiting for) its start-up turn."""
        for gpu in self._gpus.values():
            if gpu.turn is not None and gpu.turn.waiter.key == key:
                return self._release_turn(gpu, now)
            for waiter in gpu.queue:
                if waiter.key == key:
                    gpu.queue.remove(waiter)
                    return self._serve(gpu, now)
        return []

    def _advance_turn(self, gpu: _Gpu, now: float) -> list[Send]:
        if gpu.turn is not None or not gpu.queue:
            return []
        head = gpu.queue[0]
        need = head.request.static + head.request.kv_min
        if gpu.unleased < need:
            return []
        gpu.queue.popleft()
        gpu.static_sum += head.request.static
        gpu.min_sum += head.request.kv_min
        gpu.charged += head.request.kv_min
        gpu.turn = _Turn(
            waiter=head,
            granted_at=now,
            expires_at=now + self._turn_hold_s,
            reserved_static=head.request.static,
            reserved_min=head.request.kv_min,
        )
        log.info(
            "start-up turn on GPU %d to pid %d after %.2f s (reserved static %s, kv min %s)",
            gpu.info.index,
            head.pid,
            now - head.since,
            _size(head.request.static),
            _size(head.request.kv_min),
        )
        return [Send("turn", head.key, TurnGranted(seq=head.request.seq, hold_s=self._turn_hold_s))]

    def _release_turn(self, gpu: _Gpu, now: float) -> list[Send]:
        turn = gpu.turn
        if turn is None:
            return []
        gpu.static_sum -= turn.reserved_static
        gpu.min_sum -= turn.reserved_min
        gpu.charged -= turn.reserved_min
        gpu.turn = None
        return self._serve(gpu, now)

    # --- administration -----------------------------------------------------------------

    def set_max(self, pool_id: int, kv_max: int | None, now: float) -> list[Send]:
        """Change a pool's cap; a lease above the new cap is reclaimed down to it."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        if kv_max is not None:
            kv_max = _align_down(kv_max, pool.page)
            if kv_max < pool.kv_min:
                raise ValueError(
                    f"max {_size(kv_max)} is below pool {pool.name}'s kv min {_size(pool.kv_min)}"
                )
        pool.kv_max = kv_max
        sends: list[Send] = []
        if kv_max is not None:
            pool.want = min(pool.want, kv_max)
            if pool.lease > kv_max:
                sends.append(self._reclaim(gpu, pool, kv_max, now, "max lowered"))
        log.info("pool %s max set to %s", pool.name, "none" if kv_max is None else _size(kv_max))
        return sends + self._serve(gpu, now)

    def set_draining(self, gpu_uuid: str, draining: bool, now: float) -> list[Send]:
        """Drain a GPU (reclaim every pool to its minimum, admit nothing new) or undo it."""
        gpu = self._gpu(gpu_uuid)
        gpu.draining = draining
        sends: list[Send] = []
        if draining:
            while gpu.queue:  # engines not started yet: start them elsewhere
                waiter = gpu.queue.popleft()
                reason = f"GPU {gpu.info.index} is draining: it takes no new engines"
                sends.append(Send("turn", waiter.key, TurnRefused(waiter.request.seq, reason)))
            for pool in gpu.pools.values():
                if pool.lease > pool.floor and (
                    pool.reclaim is None or pool.reclaim.target > pool.floor
                ):
                    sends.append(self._reclaim(gpu, pool, pool.floor, now, "draining"))
        log.info("GPU %d %s", gpu.info.index, "draining" if draining else "no longer draining")
        return sends + self._serve(gpu, now)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        """Record a GPU's health: unhealthy GPUs take no new pools and lend nothing more."""
        self._gpu(gpu_uuid).healthy = healthy

    def _gpu(self, selector: str) -> _Gpu:
        gpu = self._gpus.get(selector)
        if gpu is None and selector.isdigit():
            gpu = next((g for g in self._gpus.values() if g.info.index == int(selector)), None)
        if gpu is None:
            raise KeyError(f"no GPU {selector!r} on this node (by UUID or index)")
        return gpu

    def record_audit(self, pool_id: int, device_bytes: int | None, over_lease: bool) -> bool:
        """Store what the device shows for a pool; True when ``over_lease`` just turned on."""
        pool = self._pools.get(pool_id)
        if pool is None:
            return False
        turned_on = over_lease and not pool.over_lease
        pool.device_bytes = device_bytes
        pool.over_lease = over_lease
        return turned_on

    # --- views --------------------------------------------------------------------------

    def view(self, now: float) -> BooksView:
        """Everything, as plain values."""
        gpus = []
        for gpu in sorted(self._gpus.values(), key=lambda g: g.info.index):
            pools = gpu.pools.values()
            turn = gpu.turn
            gpus.append(
                GpuView(
                    uuid=gpu.info.uuid,
                    index=gpu.info.index,
                    name=gpu.info.name,
                    total=gpu.info.total_bytes,
                    headroom=gpu.headroom,
                    healthy=gpu.healthy,
                    draining=gpu.draining,
                    static=gpu.static_sum,
                    kv_min=gpu.min_sum,
                    kv_lease=sum(p.lease for p in pools),
                    kv_charged=gpu.charged,
                    kv_mapped=sum(p.usage.mapped for p in pools),
                    kv_used=sum(p.usage.used for p in pools),
                    free=gpu.placement_free,
                    unleased=gpu.unleased,
                    pools=len(gpu.pools),
                    turn_holder=f"pid {turn.waiter.pid}" if turn else "",
                    turn_waiting=len(gpu.queue),
                )
            )
        pools_view = [self._pool_view(p, now) for p in sorted(self._pools.values(), key=_order)]
        return BooksView(gpus=gpus, pools=pools_view, recovering=self.recovering)

    @staticmethod
    def _pool_view(pool: PoolRecord, now: float) -> PoolView:
        hello = pool.hello
        pending = pool.reclaim
        return PoolView(
            id=pool.id,
            name=pool.name,
            gpu=pool.gpu,
            pid=pool.pid,
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
            kv_min=pool.kv_min,
            kv_max=pool.kv_max,
            lease=pool.lease,
            charged=pool.charge,
            want=pool.want,
            mapped=pool.usage.mapped,
            used=pool.usage.used,
            cached=pool.usage.cached,
            reserved=pool.usage.reserved,
            device_bytes=pool.device_bytes,
            over_lease=pool.over_lease,
            reclaim_target=pending.target if pending else None,
            reclaim_overdue=bool(pending and pending.overdue),
            orphaned=pool.orphaned_at is not None,
            age_s=round(now - pool.admitted_at, 3),
        )

    def check(self) -> None:
        """Recompute every running sum from scratch and raise if one drifted (tests)."""
        for gpu in self._gpus.values():
            static = sum(p.static for p in gpu.pools.values())
            kv_min = sum(p.kv_min for p in gpu.pools.values())
            charged = 0
            for p in gpu.pools.values():
                pending = p.reclaim.from_bytes if p.reclaim else 0
                expected = max(p.kv_min, p.lease, pending)
                if p.charge != expected:
                    raise AssertionError(f"pool {p.name}: charge {p.charge} != {expected}")
                charged += expected
                if p.lease % p.page:
                    raise AssertionError(f"pool {p.name}: lease {p.lease} not page-aligned")
            if gpu.turn is not None:
                static += gpu.turn.reserved_static
                kv_min += gpu.turn.reserved_min
                charged += gpu.turn.reserved_min
            if (gpu.static_sum, gpu.min_sum, gpu.charged) != (static, kv_min, charged):
                raise AssertionError(
                    f"GPU {gpu.info.index}: sums {(gpu.static_sum, gpu.min_sum, gpu.charged)} "
                    f"!= {(static, kv_min, charged)}"
                )


def _order(pool: PoolRecord) -> tuple[str, int]:
    return (pool.gpu, pool.id)
