"""Start-up turns: one engine per GPU starts at a time.

Engines profile the GPU's free memory when they start and mis-size each other when they
start together, so the broker serializes their start-up. An engine asks for its GPU's
turn (:class:`~kvshare.api.wire.TurnRequest`, with its static footprint and ``kv_min``)
and waits in the GPU's queue. The head of the queue gets the turn once the GPU's unleased
memory covers both (the books reclaim for it, and hold grants back from it meanwhile):
the turn *reserves* them, so nothing else is lent out of that room, and the pool the
engine then creates takes the reservation over. The turn ends when the engine says it is
done, when its connection closes, or after ``hold_s``.

:class:`StartupTurns` keeps each GPU's queue and turn in its
:class:`~kvshare.deviceplugin.records.GpuRecord`; the books call it and then serve the
GPU (a released reservation is memory for the waiters).
"""

from __future__ import annotations

import logging

from kvshare.api.wire import Hello, TurnGranted, TurnRefused, TurnRequest
from kvshare.deviceplugin.records import GpuRecord, Send, Turn, TurnWaiter, size

__all__ = ["StartupTurns"]

log = logging.getLogger(__name__)


class StartupTurns:
    """The start-up turn of every GPU (see the module doc). Not thread-safe: used under
    the books' caller's lock."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    @staticmethod
    def refusal(gpu: GpuRecord, request: TurnRequest) -> str | None:
        """Why ``request`` may not queue for ``gpu``'s turn, fit aside (None: it may)."""
        if gpu.draining or not gpu.healthy:
            state = "draining" if gpu.draining else "unhealthy"
            return f"GPU {gpu.info.index} is {state}: it takes no new engines"
        if min(request.static, request.kv_min) < 0:
            return "static and kv min must be >= 0"
        return None

    @staticmethod
    def enqueue(gpu: GpuRecord, key: int, request: TurnRequest, pid: int, now: float) -> None:
        """Queue connection ``key`` for ``gpu``'s turn."""
        gpu.queue.append(TurnWaiter(key=key, request=request, pid=pid, since=now))

    def advance(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Give the turn to the head of the queue if the GPU has room for it."""
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
        gpu.turn = Turn(
            waiter=head,
            granted_at=now,
            expires_at=now + self.hold_s,
            reserved_static=head.request.static,
            reserved_min=head.request.kv_min,
        )
        log.info(
            "start-up turn on GPU %d to pid %d after %.2f s (reserved static %s, kv min %s)",
            gpu.info.index,
            head.pid,
            now - head.since,
            size(head.request.static),
            size(head.request.kv_min),
        )
        return [Send("turn", head.key, TurnGranted(seq=head.request.seq, hold_s=self.hold_s))]

    @staticmethod
    def release(gpu: GpuRecord) -> bool:
        """End ``gpu``'s turn and free what it still reserves; whether there was one."""
        turn = gpu.turn
        if turn is None:
            return False
        gpu.static_sum -= turn.reserved_static
        gpu.min_sum -= turn.reserved_min
        gpu.charged -= turn.reserved_min
        gpu.turn = None
        return True

    @staticmethod
    def withdraw(gpu: GpuRecord, key: int) -> bool:
        """Connection ``key`` left ``gpu``'s queue or gave its turn back; whether it was
        there."""
        if gpu.turn is not None and gpu.turn.waiter.key == key:
            return StartupTurns.release(gpu)
        for waiter in gpu.queue:
            if waiter.key == key:
                gpu.queue.remove(waiter)
                return True
        return False

    @staticmethod
    def expired(gpu: GpuRecord, now: float) -> bool:
        """Take back a turn held past its time; whether one was."""
        turn = gpu.turn
        if turn is None or now < turn.expires_at:
            return False
        log.warning(
            "start-up turn on GPU %d held for %.0f s by pid %d: taking it back",
            gpu.info.index,
            now - turn.granted_at,
            turn.waiter.pid,
        )
        return StartupTurns.release(gpu)

    @staticmethod
    def refuse_queued(gpu: GpuRecord, reason: str) -> list[Send]:
        """Refuse every engine still waiting for ``gpu``'s turn (a drain)."""
        sends = []
        while gpu.queue:
            waiter = gpu.queue.popleft()
            sends.append(Send("turn", waiter.key, TurnRefused(waiter.request.seq, reason)))
        return sends

    @staticmethod
    def matching(gpu: GpuRecord, hello: Hello, pid: int) -> Turn | None:
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
    def hand_over(gpu: GpuRecord, turn: Turn) -> None:
        """The pool's own static and kv_min replace what the turn reserved for it."""
        gpu.static_sum -= turn.reserved_static
        gpu.min_sum -= turn.reserved_min
        gpu.charged -= turn.reserved_min
        turn.reserved_static = turn.reserved_min = 0
