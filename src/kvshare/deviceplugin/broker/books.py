"""The broker's books: per-GPU budgets, pool leases, reclaims and start-up turns.

Pure bookkeeping, no sockets and no clock of its own: every operation takes the current
(monotonic) time and returns the messages to send as a list of :class:`Send`. The
server (:mod:`kvshare.deviceplugin.broker.server`) owns the sockets and calls in under its lock.
Who gets memory and what is reclaimed from whom is the policy's to decide
(:mod:`kvshare.deviceplugin.broker.policy`); the books apply its decisions within the rules
below. This module takes the pools' lease traffic (asks, reports, departures), the
timers and the start-up turn requests, and hands the rest on: grants and reclaims are in
:mod:`kvshare.deviceplugin.broker.lending`, admission (and re-declaration after a restart) in
:mod:`kvshare.deviceplugin.broker.admission`, changes from outside (a pool's cap or policy, a
GPU's drain or health, the audit's findings) in :mod:`kvshare.deviceplugin.broker.controls`,
start-up turns in :mod:`kvshare.deviceplugin.broker.turns`, the pools expected back after a
restart in :mod:`kvshare.deviceplugin.broker.recovery`, the records in
:mod:`kvshare.deviceplugin.broker.records`.

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

from kvshare.api.wire import Hello, Lease, Report, TurnRefused, TurnRequest
from kvshare.deviceplugin.broker.admission import Admission, Admitter, no_fit
from kvshare.deviceplugin.broker.controls import Controls
from kvshare.deviceplugin.broker.lending import GRANTED, Lender
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY, Policy, policy_named
from kvshare.deviceplugin.broker.records import (
    BrokerEvents,
    ExpectedPool,
    GpuRecord,
    PoolRecord,
    Send,
    align_up,
    size,
)
from kvshare.deviceplugin.broker.recovery import Recovery
from kvshare.deviceplugin.broker.turns import StartupTurns
from kvshare.deviceplugin.broker.views import BooksView
from kvshare.deviceplugin.inventory import GpuInfo

__all__ = [
    "Admission",
    "Books",
    "BrokerEvents",
    "ExpectedPool",
    "PoolRecord",
    "Send",
]

log = logging.getLogger(__name__)

# Reasons a Lease reply gives besides GRANTED; the part before ':' is the denial label
# in metrics.
PARTIAL = "partial: reclaiming from other pools"
WAITING = "waiting: reclaiming from other pools"
FULL = "full: no unleased memory and this pool is at its fair share"
AT_MAX = "max: the lease is at the pool's kv max"
RECOVERING = "recovering: the broker is rebuilding its books after a restart"
DRAINING = "draining: this GPU is being drained to each pool's minimum"
RECLAIMING = "reclaiming: this pool has an unacknowledged reclaim"
UNHEALTHY = "unhealthy: this GPU is reported unhealthy"


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
        self._turns = StartupTurns(turn_hold_s)
        self._orphan_grace_s = orphan_grace_s
        self._orphan_wait_s = orphan_wait_s
        self._events = events or BrokerEvents()
        self._recovery = Recovery(self._gpus, expected, recovery_deadline)
        self._lender = Lender(
            self._gpus,
            policy=policy or policy_named(DEFAULT_POLICY),
            turns=self._turns,
            recovery=self._recovery,
            events=self._events,
            reclaim_deadline_s=reclaim_deadline_s,
        )
        self._admitter = Admitter(
            self._gpus,
            self._pools,
            known=self.gpu_uuids(),
            turns=self._turns,
            recovery=self._recovery,
            lender=self._lender,
            events=self._events,
        )
        self._controls = Controls(self._gpus, self._pools, turns=self._turns, lender=self._lender)

    # --- queries ------------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether pools of the previous broker are still expected to re-declare."""
        return self._recovery.active

    @property
    def policy(self) -> Policy:
        """The policy deciding grants and reclaims."""
        return self._lender.policy

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

    # --- admission (see :mod:`kvshare.deviceplugin.broker.admission`) --------------------------

    def admit(self, hello: Hello, pid: int, now: float) -> Admission:
        """Admit the pool saying ``hello`` from process ``pid``, or refuse it; a pool that
        resumes re-declares what it holds."""
        return self._admitter.admit(hello, pid, now)

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
        if asked <= pool.lease:
            # It needs no more than it holds: no longer waiting, so an ask for more later
            # queues behind the pools that waited meanwhile.
            pool.waiting_since = None
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
        asked_to = self._lender.policy.ask(gpu.pool_state(pool))
        grown = self._lender.apply_grants(gpu, [(pool.id, asked_to)])
        granted = grown.pop(pool.id, 0)
        sends = self._lender.announce(gpu, grown)
        if pool.lease >= target:
            pool.waiting_since = None
            reason = AT_MAX if at_max else GRANTED
        else:
            sends += self._lender.rebalance(gpu, now)
            reclaiming = any(p.reclaim and not p.reclaim.overdue for p in gpu.pools.values())
            reason = (PARTIAL if granted else WAITING) if reclaiming else FULL
            if not granted:
                self._events.denied(pool.gpu, reason.split(":", 1)[0])
        return [Send("pool", pool_id, Lease(seq=seq, limit=pool.lease, reason=reason)), *sends]

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
                    self._lender.reclaim_deadline_s,
                )
        self._lender.recharge(gpu, pool)
        if acknowledged or released:
            sends = self._lender.serve(gpu, now)
            if acknowledged and pending is not None:
                self._lender.settle(gpu, pool, pending)
            return sends
        # A pending reclaim stands even when blocks are in use above its target: the pool
        # releases them as their requests finish (see the module doc).
        if not self.recovering and self._lender.waiting(gpu):
            # Usage moved: who the policy grows, and what other pools may be asked to give
            # back, moved with it.
            return self._lender.serve(gpu, now)
        return [] if self.recovering else self._lender.withdraw_unneeded(gpu, now)

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
        return self._lender.serve(gpu, now)

    def orphan(self, pool_id: int, now: float, *, watched: bool) -> None:
        """The pool's connection closed without a goodbye. It is removed when its process
        exits (the broker calls :meth:`remove`), or when it has not reconnected within
        ``orphan_wait_s`` (``orphan_grace_s`` if its process is not ``watched``)."""
        pool = self._pools.get(pool_id)
        if pool is not None and pool.orphaned_at is None:
            pool.orphaned_at = now
            pool.orphan_deadline = now + (self._orphan_wait_s if watched else self._orphan_grace_s)

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
                sends += self._lender.rebalance(gpu, now)
        for gpu in self._gpus.values():
            if self._turns.expired(gpu, now):
                sends += self._lender.serve(gpu, now)
        if self._recovery.deadline is not None and now >= self._recovery.deadline:
            sends += self._lender.end_recovery(now)
        return sends, removed

    # --- recovery after a broker restart ------------------------------------------------

    def forget_expected(self, pid: int, now: float) -> list[Send]:
        """An expected pool's process is gone: stop waiting for it."""
        if not self._recovery.forget(pid):
            return []
        return self._lender.end_recovery_if_done(now)

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
        return [send for queue in queued for send in self._lender.serve(queue, now)]

    def turn_done(self, key: int, now: float) -> list[Send]:
        """Connection ``key`` is done with (or gave up waiting for) its start-up turn."""
        for gpu in self._gpus.values():
            refusals = self._turns.withdraw(gpu, key)
            if refusals is not None:
                return refusals + [
                    s for g in self._gpus.values() for s in self._lender.serve(g, now)
                ]
        return []

    # --- controls (see :mod:`kvshare.deviceplugin.broker.controls`) ----------------------------

    def set_max(self, pool_id: int, kv_max: int | None, now: float) -> list[Send]:
        """Change a pool's cap; a lease above the new cap is reclaimed down to it."""
        return self._controls.set_max(pool_id, kv_max, now)

    def set_policy(
        self, pool_id: int, kv_min: int, kv_max: int | None, priority: int, now: float
    ) -> list[Send]:
        """Change a pool's minimum, cap and priority in place, or raise ``ValueError``
        and change nothing."""
        return self._controls.set_policy(pool_id, kv_min, kv_max, priority, now)

    def set_draining(self, gpu_uuid: str, draining: bool, now: float) -> list[Send]:
        """Drain a GPU (reclaim every pool to its minimum, admit nothing new) or undo it."""
        return self._controls.set_draining(gpu_uuid, draining, now)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        """Record a GPU's health: unhealthy GPUs take no new pools and lend nothing more."""
        self._controls.set_healthy(gpu_uuid, healthy)

    def reclaim_overuse(self, pool_id: int, excess: int, now: float) -> list[Send]:
        """Reclaim ``excess`` bytes of a pool's lease that its process overuses."""
        return self._controls.reclaim_overuse(pool_id, excess, now)

    def record_audit(self, pool_id: int, device_bytes: int | None, over_lease: bool) -> bool:
        """Store what the device shows for a pool; True when ``over_lease`` just turned on."""
        return self._controls.record_audit(pool_id, device_bytes, over_lease)

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
