"""Lending: how the books move memory between the pools of a GPU.

Grants come out of unleased memory, reclaims take it back with a deadline; the policy
(:mod:`kvshare.deviceplugin.broker.policy`) says who gets what and who gives back, and
:class:`Lender` applies that within the rules of the books (see
:mod:`kvshare.deviceplugin.broker.books`), keeping every pool's charge and its GPU's sums in
step. Nothing is lent while the books are recovering after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvshare.api.wire import Lease, Reclaim
from kvshare.deviceplugin.broker.policy import Policy
from kvshare.deviceplugin.broker.records import (
    BrokerEvents,
    GpuRecord,
    PendingReclaim,
    PoolRecord,
    Send,
    align_down,
    align_up,
    size,
)
from kvshare.deviceplugin.broker.recovery import Recovery
from kvshare.deviceplugin.broker.turns import StartupTurns

__all__ = ["CONTENTION", "GRANTED", "RESENT", "Lender"]

log = logging.getLogger(__name__)

# The reason a Lease gives when it grants what was asked, or grows a pool unasked.
GRANTED = "granted"
# Why reclaims are sent (the Reclaim message says so).
CONTENTION = "contention"
RESENT = "resent"


class Lender:
    """Grants and reclaims on every GPU of the node (see the module doc). Not
    thread-safe: used under the books' caller's lock."""

    def __init__(
        self,
        gpus: Mapping[str, GpuRecord],
        *,
        policy: Policy,
        turns: StartupTurns,
        recovery: Recovery,
        events: BrokerEvents,
        reclaim_deadline_s: float,
    ) -> None:
        self._gpus = gpus
        self._policy = policy
        self._turns = turns
        self._recovery = recovery
        self._events = events
        self.reclaim_deadline_s = reclaim_deadline_s
        self._next_seq = 1

    @property
    def policy(self) -> Policy:
        """The policy deciding grants and reclaims."""
        return self._policy

    @staticmethod
    def waiting(gpu: GpuRecord) -> list[PoolRecord]:
        """The pools of ``gpu`` that may hold more than their lease and are not being
        reclaimed from."""
        return [p for p in gpu.pools.values() if p.reclaim is None and gpu.cap(p) > p.lease]

    def grant(self, gpu: GpuRecord, pool: PoolRecord, target: int, holdback: int) -> int:
        """Grow ``pool`` toward ``target`` (never beyond what it may hold) from unleased
        memory less ``holdback``; returns bytes granted."""
        target = min(target, max(gpu.may_grow_to(pool), gpu.cap(pool)))
        room = gpu.unleased - holdback + (pool.charge - pool.lease)
        step = align_down(min(target - pool.lease, room), pool.page)
        if step <= 0:
            return 0
        pool.lease += step
        pool.granted_total += step
        gpu.granted_total += step
        self.recharge(gpu, pool)
        self._events.granted(pool.gpu, step)
        return step

    @staticmethod
    def recharge(gpu: GpuRecord, pool: PoolRecord) -> None:
        """Bring ``pool``'s charge, and ``gpu``'s sum of charges, up to date."""
        # What a pool reports holding beyond its lease is not charged: reports are the
        # pool's word, and a pool must not be able to push others out by inflating it.
        # Real over-use is caught by the audit against the device.
        charge = pool.charged_bytes()
        gpu.charged += charge - pool.charge
        pool.charge = charge

    def apply_grants(self, gpu: GpuRecord, grants: list[tuple[int, int]]) -> dict[int, int]:
        """Apply the policy's grants in order, each as far as the rules allow (a pool with
        an unacknowledged reclaim gets nothing); returns bytes granted per pool id."""
        holdback = gpu.turn_need()
        grown: dict[int, int] = {}
        for pool_id, target in grants:
            pool = gpu.pools.get(pool_id)
            if pool is None or pool.reclaim is not None or target <= pool.lease:
                continue
            step = self.grant(gpu, pool, target, holdback)
            if step:
                grown[pool_id] = grown.get(pool_id, 0) + step
        return grown

    @staticmethod
    def announce(gpu: GpuRecord, grown: dict[int, int]) -> list[Send]:
        """Tell the pools that grew without asking their new lease."""
        sends = []
        for pool_id in grown:
            pool = gpu.pools[pool_id]
            if pool.lease >= gpu.cap(pool):
                pool.waiting_since = None
            sends.append(Send("pool", pool.id, Lease(seq=0, limit=pool.lease, reason=GRANTED)))
        return sends

    def serve(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Hand unleased memory to the start-up turn first, then to the pools the policy
        chooses, then reclaim for whoever still waits."""
        if self._recovery.active:
            return []
        sends = self._turns.advance(gpu, now)
        if self.waiting(gpu):
            grants = self._policy.grants(gpu.snapshot(now))
            sends += self.announce(gpu, self.apply_grants(gpu, grants))
        return sends + self.rebalance(gpu, now) + self.withdraw_unneeded(gpu, now)

    def withdraw_unneeded(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Call off the reclaims nobody needs any more: the policy would grow no pool, no
        engine waits for the start-up turn, the GPU is not over-committed, draining or
        unhealthy. A pool still releasing one (blocks in use that may never finish while
        it serves) keeps what it holds, as its lease, and may ask for more again."""
        if (
            not any(p.reclaim and p.reclaim.for_waiters for p in gpu.pools.values())
            or gpu.turn_need()
            or gpu.unleased < 0
            or gpu.draining
            or not gpu.healthy
        ):
            return []
        # Who still waits is the policy's to say: an ask it no longer counts (the default
        # policy lets one lapse when the pool stops repeating it) needs no reclaim.
        if self._policy.waiting_for(gpu.snapshot(now)):
            return []
        sends = []
        for pool in gpu.pools.values():
            pending = pool.reclaim
            if pending is None or not pending.for_waiters or pool.held > gpu.may_grow_to(pool):
                continue
            pool.reclaim = None
            pool.lease = max(pool.lease, min(pending.from_bytes, align_up(pool.held, pool.page)))
            self.recharge(gpu, pool)
            log.debug("reclaim %d of pool %s called off: nobody waits", pending.seq, pool.name)
            self.settle(gpu, pool, pending)
            sends.append(Send("pool", pool.id, Lease(seq=0, limit=pool.lease, reason=GRANTED)))
        return sends

    def settle(self, gpu: GpuRecord, pool: PoolRecord, ended: PendingReclaim) -> None:
        """A reclaim of ``pool`` ended (released or called off): one made for waiting pools
        after which no other pool was granted memory is counted."""
        if not ended.for_waiters:
            return
        if gpu.granted_total - pool.granted_total > ended.others_granted:
            return
        self._events.reclaim_ungranted(pool.gpu)
        log.info("reclaim %d of pool %s granted nothing to another pool", ended.seq, pool.name)

    def rebalance(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Issue the reclaims the policy asks for (for waiters, a waiting start-up turn,
        or an over-committed GPU), each within the rules of the books."""
        if self._recovery.active:
            return []
        reason = "draining" if gpu.draining else CONTENTION
        sends = []
        for pool_id, asked in self._policy.reclaims(gpu.snapshot(now)).items():
            pool = gpu.pools.get(pool_id)
            if pool is None or (pool.reclaim is not None and pool.reclaim.overdue):
                continue
            target = max(align_down(asked, pool.page), align_up(pool.floor, pool.page))
            if target < pool.lease:
                sends.append(self.reclaim(gpu, pool, target, now, reason))
        return sends

    def reclaim(
        self, gpu: GpuRecord, pool: PoolRecord, target: int, now: float, reason: str
    ) -> Send:
        """Lower ``pool``'s lease to ``target`` at once and ask it to release down to it
        within the deadline (``reason`` goes into the message); a reclaim already pending
        is deepened, or sent again (:data:`RESENT`)."""
        seq = self._next_seq
        self._next_seq += 1
        previous = pool.reclaim
        resent = previous if reason == RESENT else None
        if resent is not None:
            for_waiters = resent.for_waiters
        else:
            # Deepening a reclaim that was needed for more than waiters keeps it needed.
            for_waiters = self._for_waiters(gpu, reason) and (
                previous is None or previous.for_waiters
            )
        pool.reclaim = PendingReclaim(
            seq=seq,
            target=target,
            from_bytes=previous.from_bytes if previous else pool.lease,
            issued_at=previous.issued_at if previous else now,
            # Sent again (the pool reconnected), it is the same reclaim: reconnecting buys
            # no time and clears no missed deadline.
            deadline=resent.deadline if resent else now + self.reclaim_deadline_s,
            overdue=resent.overdue if resent else False,
            for_waiters=for_waiters,
            others_granted=(
                previous.others_granted if previous else gpu.granted_total - pool.granted_total
            ),
        )
        pool.lease = target
        # The pool asks again if it still needs more; until then it is not waiting.
        pool.want = min(pool.want, target)
        pool.asked = min(pool.asked, target)
        pool.waiting_since = None
        self.recharge(gpu, pool)
        self._events.reclaim_issued(pool.gpu)
        log.debug("reclaim %d: pool %s down to %s (%s)", seq, pool.name, size(target), reason)
        left = max(pool.reclaim.deadline - now, 0.0)
        return Send("pool", pool.id, Reclaim(seq=seq, limit=target, deadline_s=left, reason=reason))

    @staticmethod
    def _for_waiters(gpu: GpuRecord, reason: str) -> bool:
        """Whether a reclaim sent now for ``reason`` would be only for waiting pools (not
        for an engine waiting to start, an over-committed GPU, a drain or a lowered max)."""
        return reason == CONTENTION and not (gpu.turn_need() or gpu.unleased < 0)

    def end_recovery_if_done(self, now: float) -> list[Send]:
        """:meth:`end_recovery` once every expected pool has re-declared or is gone."""
        return self.end_recovery(now) if self._recovery.complete else []

    def end_recovery(self, now: float) -> list[Send]:
        """Stop waiting for the previous broker's pools and lend again, on every GPU."""
        if not self._recovery.finish():
            return []
        pools = sum(len(gpu.pools) for gpu in self._gpus.values())
        log.info("books rebuilt: %d pool(s) re-declared", pools)
        sends: list[Send] = []
        for gpu in self._gpus.values():
            sends += self.serve(gpu, now)
        return sends
