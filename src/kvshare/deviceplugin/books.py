"""The broker's books: per-GPU budgets, pool leases, reclaims and start-up turns.

Pure bookkeeping, no sockets and no clock of its own: every operation takes the current
(monotonic) time and returns the messages to send as a list of :class:`Send`. The
server (:mod:`kvshare.deviceplugin.broker`) owns the sockets and calls in under its lock.
Who gets memory and what is reclaimed from whom is the policy's to decide
(:mod:`kvshare.deviceplugin.policy`); the books apply its decisions within the rules
below. Start-up turns are in :mod:`kvshare.deviceplugin.turns`, recovery after a restart
in :mod:`kvshare.deviceplugin.recovery`, the records in :mod:`kvshare.deviceplugin.records`.

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

Rules the policy works within
-----------------------------
- Admission guarantees ``kv_min``: a pool is admitted only when ``static + kv_min`` fits
  in ``total - headroom - static - kv_min`` of the pools already there; otherwise it is
  refused with the numbers. Its minimum is granted at admission.
- Grants are page-aligned, come only from unleased memory less what the engine waiting
  for the start-up turn needs, and never exceed the pool's ``kv_max`` (its floor on a GPU
  that is draining or unhealthy).
- Reclaims never go below a pool's *floor*: ``kv_min``, and at least the page that holds
  its null block, which a pool never releases. Each reclaim has a deadline. A pool that
  misses it is reported (event and log) and skipped for further reclaims; its memory stays
  charged to it until it does release. A pool with an unacknowledged reclaim is not
  granted more until it acknowledges.
- Start-up turns: one engine per GPU at a time; the turn reserves the engine's static
  footprint and ``kv_min`` (reclaiming if needed) before it is granted, and the pool the
  engine then creates takes over that reservation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvshare.api.wire import (
    Hello,
    Lease,
    Reclaim,
    Report,
    TurnRefused,
    TurnRequest,
)
from kvshare.deviceplugin.admission import MAX_PRIORITY, hello_problem, no_fit
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.deviceplugin.policy import DEFAULT_POLICY, Policy, policy_named
from kvshare.deviceplugin.records import (
    BrokerEvents,
    ExpectedPool,
    GpuRecord,
    PendingReclaim,
    PoolRecord,
    Send,
    align_down,
    align_up,
    size,
)
from kvshare.deviceplugin.recovery import Recovery
from kvshare.deviceplugin.turns import StartupTurns
from kvshare.deviceplugin.views import BooksView

__all__ = [
    "Admission",
    "Books",
    "BrokerEvents",
    "ExpectedPool",
    "PoolRecord",
    "Send",
]

log = logging.getLogger(__name__)

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
# Why reclaims are sent (the Reclaim message says so).
CONTENTION = "contention"
RESENT = "resent"


@dataclass(frozen=True)
class Admission:
    """The outcome of a Hello: the pool's record, or why it was refused."""

    record: PoolRecord | None
    reason: str
    sends: list[Send]


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
        policy: Policy | None = None,
    ) -> None:
        self._gpus = {gpu.uuid: GpuRecord(info=gpu, headroom=headroom) for gpu in gpus}
        for gpu in self._gpus.values():
            gpu.healthy = gpu.info.healthy
            if gpu.info.total_bytes <= headroom:
                raise ValueError(
                    f"headroom {size(headroom)} leaves nothing of GPU {gpu.info.index} "
                    f"({size(gpu.info.total_bytes)}): lower --headroom"
                )
        self._pools: dict[int, PoolRecord] = {}
        self._reclaim_deadline_s = reclaim_deadline_s
        self._turns = StartupTurns(turn_hold_s)
        self._orphan_grace_s = orphan_grace_s
        self._orphan_wait_s = orphan_wait_s
        self._events = events or BrokerEvents()
        self._policy: Policy = policy or policy_named(DEFAULT_POLICY)
        self._next_pool_id = 1
        self._next_seq = 1
        self._recovery = Recovery(self._gpus, expected, recovery_deadline)

    # --- queries ------------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether pools of the previous broker are still expected to re-declare."""
        return self._recovery.active

    @property
    def policy(self) -> Policy:
        """The policy deciding grants and reclaims."""
        return self._policy

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
        if self._recovery.deadline is not None:
            times.append(self._recovery.deadline)
        return min(times) if times else None

    # --- admission ----------------------------------------------------------------------

    def admit(self, hello: Hello, pid: int, now: float) -> Admission:
        """Admit the pool saying ``hello`` from process ``pid``, or refuse it."""
        gpu = self._gpus.get(hello.gpu)
        problem = hello_problem(hello, gpu, self.gpu_uuids())
        if problem is not None or gpu is None:
            reason = problem or "unknown GPU"
            self._events.refused(hello.gpu, reason.split(":", 1)[0])
            return Admission(None, reason, [])
        if hello.resume:
            return self._resume(gpu, hello, pid, now)
        return self._admit_new(gpu, hello, pid, now)

    def _admit_new(self, gpu: GpuRecord, hello: Hello, pid: int, now: float) -> Admission:
        turn = self._turns.matching(gpu, hello, pid)
        # An engine that got its start-up turn before a drain or a health change has its
        # room reserved: it may finish starting.
        if turn is None and (gpu.draining or not gpu.healthy):
            state = "draining" if gpu.draining else "unhealthy"
            reason = f"GPU {gpu.info.index} ({gpu.info.uuid}) is {state}: it takes no new pools"
            self._events.refused(hello.gpu, state)
            return Admission(None, reason, [])
        credit = turn.reserved_static + turn.reserved_min if turn else 0
        kv_min = align_up(hello.kv_min, hello.page_size)
        if hello.static + kv_min > gpu.placement_free + credit:
            reason = no_fit(gpu, hello.static, kv_min)
            self._events.refused(hello.gpu, "fit")
            return Admission(None, reason, [])
        if turn is not None:
            self._turns.hand_over(gpu, turn)
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
            size(hello.static),
            size(record.kv_min),
            "none" if record.kv_max is None else size(record.kv_max),
            hello.priority,
        )
        return Admission(record, "", sends)

    def _resume(self, gpu: GpuRecord, hello: Hello, pid: int, now: float) -> Admission:
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
                sends.append(self._reclaim(gpu, existing, existing.reclaim.target, now, RESENT))
            log.info("pool %s (pid %d) reconnected", existing.name, pid)
            self._events.admitted(hello.gpu, resumed=True)
            return Admission(existing, "", sends)
        if self._recovery.claim(pid) is None:
            return self._resume_unknown(gpu, hello, pid, now)
        lease = align_up(max(hello.lease, hello.held), hello.page_size)
        record = self._add(gpu, hello, pid, now, lease=lease)
        record.usage = Report(mapped=hello.held, used=hello.used, cached=0, reserved=0)
        record.want = lease
        self._recharge(gpu, record)
        if gpu.unleased < 0:
            log.warning(
                "GPU %d is over-committed by %s after pool %s re-declared %s: reclaiming",
                gpu.info.index,
                size(-gpu.unleased),
                record.name,
                size(lease),
            )
        log.info(
            "pool %s (pid %d) re-declared lease %s, holding %s",
            record.name,
            pid,
            size(lease),
            size(hello.held),
        )
        self._events.admitted(hello.gpu, resumed=True)
        if self.recovering:
            sends += self._finish_recovery_if_done(now)
        else:
            sends += self._rebalance(gpu, now)
        return Admission(record, "", sends)

    def _resume_unknown(self, gpu: GpuRecord, hello: Hello, pid: int, now: float) -> Admission:
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
        declared = align_up(max(hello.lease, hello.held), hello.page_size)
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
                size(hello.held),
                size(record.lease),
            )
            sends.append(self._reclaim(gpu, record, record.lease, now, "unknown re-declaration"))
        return Admission(record, "", sends)

    def _add(self, gpu: GpuRecord, hello: Hello, pid: int, now: float, lease: int) -> PoolRecord:
        base = f"{hello.namespace}/{hello.pod}" if hello.pod else f"pid-{pid}"
        if hello.tp_size > 1 or hello.rank:
            base += f"/rank{hello.rank}"
        pool_id = self._next_pool_id
        self._next_pool_id += 1
        name = base
        if any(p.name == base and p.gpu == hello.gpu for p in self._pools.values()):
            name = f"{base}~{pool_id}"
        kv_min = align_up(hello.kv_min, hello.page_size)
        kv_max = None if hello.kv_max is None else align_down(hello.kv_max, hello.page_size)
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

    # --- leases -------------------------------------------------------------------------

    def want(self, pool_id: int, seq: int, total: int, now: float) -> list[Send]:
        """Pool ``pool_id`` asks for its lease to reach ``total``; always answers ``seq``."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        asked = pool.asked = align_up(max(total, 0), pool.page)
        at_max = pool.kv_max is not None and asked > pool.kv_max
        if pool.kv_max is not None:
            asked = min(asked, pool.kv_max)
        pool.want = max(asked, pool.floor)
        pool.wanted_at = now
        target = gpu.cap(pool)
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
        grown = self._apply_grants(gpu, self._policy.grants(gpu.snapshot(now), pool_id))
        granted = grown.pop(pool.id, 0)
        sends = self._announce(gpu, grown)
        if pool.lease >= target:
            pool.waiting_since = None
            reason = AT_MAX if at_max else GRANTED
        else:
            sends += self._rebalance(gpu, now)
            reclaiming = any(p.reclaim and not p.reclaim.overdue for p in gpu.pools.values())
            reason = (PARTIAL if granted else WAITING) if reclaiming else FULL
            if not granted:
                self._events.denied(pool.gpu, reason.split(":", 1)[0])
        return [Send("pool", pool_id, Lease(seq=seq, limit=pool.lease, reason=reason)), *sends]

    @staticmethod
    def _waiting(gpu: GpuRecord) -> list[PoolRecord]:
        return [p for p in gpu.pools.values() if p.reclaim is None and gpu.cap(p) > p.lease]

    def _grant(self, gpu: GpuRecord, pool: PoolRecord, target: int, holdback: int) -> int:
        """Grow ``pool`` toward ``target`` (never beyond what it may hold) from unleased
        memory less ``holdback``; returns bytes granted."""
        target = min(target, max(gpu.may_grow_to(pool), gpu.cap(pool)))
        room = gpu.unleased - holdback + (pool.charge - pool.lease)
        step = align_down(min(target - pool.lease, room), pool.page)
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
            and align_up(report.held, pool.page) < pending.from_bytes
        )
        if released and pending is not None:
            # The pool no longer grows beyond what it reports: the rest is free already.
            pending.from_bytes = align_up(report.held, pool.page)
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
            # Usage moved: who the policy grows, and what other pools may be asked to give
            # back, moved with it.
            return self._serve(gpu, now)
        return [] if self.recovering else self._withdraw_unneeded(gpu)

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
            size(pool.charge),
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

    def _recharge(self, gpu: GpuRecord, pool: PoolRecord) -> None:
        # What a pool reports holding beyond its lease is not charged: reports are the
        # pool's word, and a pool must not be able to push others out by inflating it.
        # Real over-use is caught by the audit against the device.
        pending = pool.reclaim.from_bytes if pool.reclaim is not None else 0
        charge = max(pool.kv_min, pool.lease, pending)
        gpu.charged += charge - pool.charge
        pool.charge = charge

    # --- serving waiters and reclaiming -------------------------------------------------

    def _apply_grants(self, gpu: GpuRecord, grants: list[tuple[int, int]]) -> dict[int, int]:
        """Apply the policy's grants in order, each as far as the rules allow (a pool with
        an unacknowledged reclaim gets nothing); returns bytes granted per pool id."""
        holdback = gpu.turn_need()
        grown: dict[int, int] = {}
        for pool_id, target in grants:
            pool = gpu.pools.get(pool_id)
            if pool is None or pool.reclaim is not None or target <= pool.lease:
                continue
            step = self._grant(gpu, pool, target, holdback)
            if step:
                grown[pool_id] = grown.get(pool_id, 0) + step
        return grown

    def _announce(self, gpu: GpuRecord, grown: dict[int, int]) -> list[Send]:
        """Tell the pools that grew without asking their new lease."""
        sends = []
        for pool_id in grown:
            pool = gpu.pools[pool_id]
            if pool.lease >= gpu.cap(pool):
                pool.waiting_since = None
            sends.append(Send("pool", pool.id, Lease(seq=0, limit=pool.lease, reason=GRANTED)))
        return sends

    def _serve(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Hand unleased memory to the start-up turn first, then to the pools the policy
        chooses, then reclaim for whoever still waits."""
        if self.recovering:
            return []
        sends = self._turns.advance(gpu, now)
        if self._waiting(gpu):
            grants = self._policy.grants(gpu.snapshot(now), None)
            sends += self._announce(gpu, self._apply_grants(gpu, grants))
        return sends + self._rebalance(gpu, now) + self._withdraw_unneeded(gpu)

    def _withdraw_unneeded(self, gpu: GpuRecord) -> list[Send]:
        """Call off the reclaims nobody needs any more: no pool waits, no engine waits for
        the start-up turn, the GPU is not over-committed, draining or unhealthy. A pool
        still releasing one (blocks in use that may never finish while it serves) keeps
        what it holds, as its lease, and may ask for more again."""
        if (
            self._waiting(gpu)
            or gpu.turn_need()
            or gpu.unleased < 0
            or gpu.draining
            or not gpu.healthy
        ):
            return []
        sends = []
        for pool in gpu.pools.values():
            pending = pool.reclaim
            if pending is None or not pending.for_waiters or pool.held > gpu.may_grow_to(pool):
                continue
            pool.reclaim = None
            pool.lease = max(pool.lease, min(pending.from_bytes, align_up(pool.held, pool.page)))
            self._recharge(gpu, pool)
            log.debug("reclaim %d of pool %s called off: nobody waits", pending.seq, pool.name)
            sends.append(Send("pool", pool.id, Lease(seq=0, limit=pool.lease, reason=GRANTED)))
        return sends

    def _rebalance(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Issue the reclaims the policy asks for (for waiters, a waiting start-up turn,
        or an over-committed GPU), each within the rules (see the module doc)."""
        if self.recovering:
            return []
        reason = "draining" if gpu.draining else CONTENTION
        sends = []
        for pool_id, asked in self._policy.reclaims(gpu.snapshot(now)).items():
            pool = gpu.pools.get(pool_id)
            if pool is None or (pool.reclaim is not None and pool.reclaim.overdue):
                continue
            target = max(align_down(asked, pool.page), align_up(pool.floor, pool.page))
            if target < pool.lease:
                sends.append(self._reclaim(gpu, pool, target, now, reason))
        return sends

    def _reclaim(
        self,
        gpu: GpuRecord,
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
        if reason == RESENT and previous is not None:
            for_waiters = previous.for_waiters
        else:
            # Deepening a reclaim that was needed for more than waiters keeps it needed.
            for_waiters = (
                reason == CONTENTION
                and not (gpu.turn_need() or gpu.unleased < 0)
                and (previous is None or previous.for_waiters)
            )
        pool.reclaim = PendingReclaim(
            seq=seq,
            target=target,
            from_bytes=previous.from_bytes if previous else pool.lease,
            issued_at=previous.issued_at if previous else now,
            deadline=deadline if deadline is not None else now + self._reclaim_deadline_s,
            for_waiters=for_waiters,
        )
        pool.lease = target
        # The pool asks again if it still needs more; until then it is not waiting.
        pool.want = min(pool.want, target)
        pool.asked = min(pool.asked, target)
        pool.waiting_since = None
        self._recharge(gpu, pool)
        self._events.reclaim_issued(pool.gpu)
        log.debug("reclaim %d: pool %s down to %s (%s)", seq, pool.name, size(target), reason)
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
                    size(pending.target),
                    now - pending.issued_at,
                    size(pool.charge),
                    size(pool.held),
                )
                sends += self._rebalance(gpu, now)
        for gpu in self._gpus.values():
            if self._turns.expired(gpu, now):
                sends += self._serve(gpu, now)
        if self._recovery.deadline is not None and now >= self._recovery.deadline:
            sends += self._finish_recovery(now)
        return sends, removed

    # --- recovery after a broker restart ------------------------------------------------

    def forget_expected(self, pid: int, now: float) -> list[Send]:
        """An expected pool's process is gone: stop waiting for it."""
        if not self._recovery.forget(pid):
            return []
        return self._finish_recovery_if_done(now)

    def _finish_recovery_if_done(self, now: float) -> list[Send]:
        return self._finish_recovery(now) if self._recovery.complete else []

    def _finish_recovery(self, now: float) -> list[Send]:
        if not self._recovery.finish():
            return []
        log.info("books rebuilt: %d pool(s) re-declared", len(self._pools))
        sends: list[Send] = []
        for gpu in self._gpus.values():
            sends += self._serve(gpu, now)
        return sends

    # --- start-up turns -----------------------------------------------------------------

    def turn_request(self, key: int, request: TurnRequest, pid: int, now: float) -> list[Send]:
        """Queue connection ``key`` for the start-up turn of ``request.gpu``."""
        gpu = self._gpus.get(request.gpu)
        if gpu is None:
            refusal: str | None = (
                f"unknown GPU {request.gpu!r}; this node has {', '.join(self.gpu_uuids())}"
            )
        else:
            refusal = self._turns.refusal(gpu, request)
            if refusal is None and request.static + request.kv_min > gpu.placement_free:
                refusal = no_fit(gpu, request.static, request.kv_min)
        if refusal is None and gpu is not None:
            queued, refusal = self._turns.enqueue(gpu, key, request, pid, now)
        if refusal is not None or gpu is None:
            return [Send("turn", key, TurnRefused(seq=request.seq, reason=refusal or ""))]
        return [send for queue in queued for send in self._serve(queue, now)]

    def turn_done(self, key: int, now: float) -> list[Send]:
        """Connection ``key`` is done with (or gave up waiting for) its start-up turn."""
        for gpu in self._gpus.values():
            refusals = self._turns.withdraw(gpu, key)
            if refusals is not None:
                return refusals + [s for g in self._gpus.values() for s in self._serve(g, now)]
        return []

    # --- administration -----------------------------------------------------------------

    def set_max(self, pool_id: int, kv_max: int | None, now: float) -> list[Send]:
        """Change a pool's cap; a lease above the new cap is reclaimed down to it."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        if kv_max is not None:
            kv_max = align_down(kv_max, pool.page)
            if kv_max < pool.kv_min:
                raise ValueError(
                    f"max {size(kv_max)} is below pool {pool.name}'s kv min {size(pool.kv_min)}"
                )
        pool.kv_max = kv_max
        sends: list[Send] = []
        # What the pool asked for beyond the old cap is wanted again under a raised one.
        wanted = max(pool.want, pool.asked)
        pool.want = max(pool.floor, wanted if kv_max is None else min(wanted, kv_max))
        if kv_max is not None and pool.lease > kv_max:
            sends.append(self._reclaim(gpu, pool, kv_max, now, "max lowered"))
        log.info("pool %s max set to %s", pool.name, "none" if kv_max is None else size(kv_max))
        return sends + self._serve(gpu, now)

    def set_policy(
        self, pool_id: int, kv_min: int, kv_max: int | None, priority: int, now: float
    ) -> list[Send]:
        """Change a pool's minimum, cap and priority in place (its pod's kvCache changed).

        A raised minimum is guaranteed at once, as at admission; when the GPU cannot hold
        it, or the values break the rules, nothing changes and ``ValueError`` says why. A
        lease above a lowered cap is reclaimed; a lowered priority gives memory back first
        from the next contention on.
        """
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        new_min = align_up(kv_min, pool.page)
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority {priority} is outside 0-{MAX_PRIORITY}")
        if kv_max is not None and align_down(kv_max, pool.page) < new_min:
            raise ValueError(f"max {size(kv_max)} is below the kv min {size(new_min)}")
        more = new_min - pool.kv_min
        if more > max(gpu.placement_free, 0):
            raise ValueError(
                f"GPU {gpu.info.index} cannot guarantee {size(more)} more kv min to pool "
                f"{pool.name}: {size(max(gpu.placement_free, 0))} is left for placement"
            )
        gpu.min_sum += more
        pool.kv_min = new_min
        pool.hello = replace(pool.hello, priority=priority)
        self._recharge(gpu, pool)
        return self.set_max(pool_id, kv_max, now)

    def set_draining(self, gpu_uuid: str, draining: bool, now: float) -> list[Send]:
        """Drain a GPU (reclaim every pool to its minimum, admit nothing new) or undo it."""
        gpu = self._gpu(gpu_uuid)
        gpu.draining = draining
        sends: list[Send] = []
        if draining:
            # Engines not started yet: start them elsewhere.
            reason = f"GPU {gpu.info.index} is draining: it takes no new engines"
            sends += self._turns.refuse_queued(gpu, reason)
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

    def _gpu(self, selector: str) -> GpuRecord:
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
        gpus = sorted(self._gpus.values(), key=lambda g: g.info.index)
        pools = sorted(self._pools.values(), key=lambda p: (p.gpu, p.id))
        return BooksView(
            gpus=[gpu.view() for gpu in gpus],
            pools=[pool.view(now) for pool in pools],
            recovering=self.recovering,
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
