"""Admission: how a pool's hello makes it a pool of the books, or why it does not.

A new pool is admitted when the hello is sound (:func:`hello_problem`) and its static
footprint and minimum fit (:func:`no_fit` says why not); its minimum is granted at once.
Their reasons start with a label (``version``, ``gpu``, ``policy``, ``fit``) before ``:``;
the metrics count refusals by it (and by ``draining`` and ``unhealthy``: a GPU in either
state takes no new pools).

A hello that *resumes* comes from a pool that holds memory already: one whose connection
dropped (the books still know it and stay the truth), one of the previous broker's pools
re-declaring after a broker restart (its declaration is the truth;
:mod:`kvshare.deviceplugin.broker.recovery` expects it), or a process nobody knows, which is
admitted like a new pool and gets what it declares only from unleased memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshare.api.wire import PROTOCOL_VERSION, Hello, Report
from kvshare.deviceplugin.broker.lending import RESENT, Lender
from kvshare.deviceplugin.broker.records import (
    BrokerEvents,
    GpuRecord,
    PoolRecord,
    Send,
    align_down,
    align_up,
    size,
)
from kvshare.deviceplugin.broker.recovery import Recovery
from kvshare.deviceplugin.broker.turns import StartupTurns

__all__ = ["MAX_PRIORITY", "Admission", "Admitter", "hello_problem", "no_fit"]

log = logging.getLogger(__name__)

MAX_PRIORITY = 1000


def hello_problem(hello: Hello, gpu: GpuRecord | None, known: Sequence[str]) -> str | None:
    """Why ``hello`` cannot be admitted on ``gpu`` (None: unknown GPU; ``known`` names the
    node's GPUs), fit aside; None when nothing is wrong with it."""
    if hello.version != PROTOCOL_VERSION:
        return (
            f"version: protocol version {hello.version} is not supported (this broker "
            f"speaks {PROTOCOL_VERSION}); run matching kvshare versions"
        )
    if gpu is None:
        return (
            f"gpu: unknown GPU {hello.gpu!r}; this node has {', '.join(known)} "
            "(KVSHARE_GPU_UUIDS must name GPUs of this node)"
        )
    if hello.page_size <= 0 or hello.page_size % 4096:
        return f"policy: page size {hello.page_size} is not a positive multiple of 4096"
    if min(hello.kv_min, hello.static, hello.held, hello.used, hello.lease, hello.rank) < 0:
        return "policy: sizes and rank must be >= 0"
    if hello.tp_size < 1:
        return "policy: tensor-parallel size must be >= 1"
    if hello.kv_max is not None and hello.kv_max < hello.kv_min:
        return f"policy: kv max {size(hello.kv_max)} is below kv min {size(hello.kv_min)}"
    if not 0 <= hello.priority <= MAX_PRIORITY:
        return f"policy: priority {hello.priority} is outside 0-{MAX_PRIORITY}"
    return None


def no_fit(gpu: GpuRecord, static: int, kv_min: int) -> str:
    """Why an engine of ``static`` + ``kv_min`` bytes does not fit on ``gpu``."""
    return (
        f"fit: static {size(static)} + kv min {size(kv_min)} does not fit on GPU "
        f"{gpu.info.index} ({gpu.info.uuid}): {size(max(gpu.placement_free, 0))} left "
        f"of {size(gpu.info.total_bytes)} (headroom {size(gpu.headroom)}, static "
        f"{size(gpu.static_sum + gpu.expected_static)} and kv min "
        f"{size(gpu.min_sum + gpu.expected_min)} committed to {len(gpu.pools)} pool(s)); "
        "lower kvCache.min or place the model on another GPU"
    )


@dataclass(frozen=True)
class Admission:
    """The outcome of a Hello: the pool's record, or why it was refused."""

    record: PoolRecord | None
    reason: str
    sends: list[Send]


class Admitter:
    """Admits pools into the books' records (see the module doc); ``known`` names the
    node's GPUs for refusals. Not thread-safe: used under the books' caller's lock."""

    def __init__(
        self,
        gpus: Mapping[str, GpuRecord],
        pools: dict[int, PoolRecord],
        *,
        known: Sequence[str],
        turns: StartupTurns,
        recovery: Recovery,
        lender: Lender,
        events: BrokerEvents,
    ) -> None:
        self._gpus = gpus
        self._pools = pools
        self._known = known
        self._turns = turns
        self._recovery = recovery
        self._lender = lender
        self._events = events
        self._next_pool_id = 1

    def admit(self, hello: Hello, pid: int, now: float) -> Admission:
        """Admit the pool saying ``hello`` from process ``pid``, or refuse it."""
        gpu = self._gpus.get(hello.gpu)
        problem = hello_problem(hello, gpu, self._known)
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
        record.sized_for = gpu.info.total_bytes
        record.want = record.kv_min
        self._lender.grant(gpu, record, record.kv_min, holdback=0)
        if record.lease < record.want:
            record.waiting_since = now
        sends = self._lender.rebalance(gpu, now)
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
                sends.append(
                    self._lender.reclaim(gpu, existing, existing.reclaim.target, now, RESENT)
                )
            log.info("pool %s (pid %d) reconnected", existing.name, pid)
            self._events.admitted(hello.gpu, resumed=True)
            return Admission(existing, "", sends)
        expected = self._recovery.claim(pid)
        if expected is None:
            return self._resume_unknown(gpu, hello, pid, now)
        lease = align_up(max(hello.lease, hello.held), hello.page_size)
        record = self._add(gpu, hello, pid, now, lease=lease)
        record.sized_for = expected.gpu_total
        if record.sized_for > gpu.info.total_bytes:
            log.warning(
                "GPU %d reports %s, less than the %s pool %s's KV cache was sized for: its "
                "engine may try to use memory this GPU does not have (restart it to size "
                "its cache for this GPU)",
                gpu.info.index,
                size(gpu.info.total_bytes),
                size(record.sized_for),
                record.name,
            )
        record.usage = Report(mapped=hello.held, used=hello.used, cached=0, reserved=0)
        record.want = lease
        self._lender.recharge(gpu, record)
        if gpu.unleased < 0:
            log.warning(
                "GPU %d is over-committed by %s after pool %s re-declared %s (its budget is "
                "smaller than before the restart): reclaiming",
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
        if self._recovery.active:
            sends += self._lender.end_recovery_if_done(now)
        else:
            sends += self._lender.rebalance(gpu, now)
        return Admission(record, "", sends)

    def _resume_unknown(self, gpu: GpuRecord, hello: Hello, pid: int, now: float) -> Admission:
        """A process this broker neither knows nor expects claims to hold memory.

        It is admitted like a new pool and gets what it declares only from unleased
        memory, and none while the books recover; whatever it holds beyond that it is
        asked to give back. Other pools' leases are never touched for it.
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
            # While the books recover, unleased memory still holds what the pools not yet
            # re-declared hold: nothing is lent until they have.
            if not self._recovery.active:
                self._lender.grant(gpu, record, declared, holdback=gpu.turn_need())
        if hello.held > record.lease:
            log.warning(
                "pool %s (pid %d) re-declared %s unknown to this broker: granted %s from "
                "unleased memory and asked it to shrink to that",
                record.name,
                pid,
                size(hello.held),
                size(record.lease),
            )
            sends.append(
                self._lender.reclaim(gpu, record, record.lease, now, "unknown re-declaration")
            )
        return Admission(record, "", sends)

    def _add(self, gpu: GpuRecord, hello: Hello, pid: int, now: float, lease: int) -> PoolRecord:
        """A new record for the pool, counted in ``gpu``'s sums; named after its pod (and
        rank), made unique on its GPU."""
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
        self._lender.recharge(gpu, record)
        return record
