"""Start-up turns: one engine per GPU starts at a time.

Engines profile the GPU's free memory when they start and mis-size each other when they
start together, so the broker serializes their start-up. An engine asks for its GPU's
turn (:class:`~kvshare.api.wire.TurnRequest`, with its static footprint and ``kv_min``)
and waits in the GPU's queue. The head of the queue gets the turn once the GPU's unleased
memory covers both (the books reclaim for it, and hold grants back from it meanwhile):
the turn *reserves* them, so nothing else is lent out of that room, and the pool the
engine then creates takes the reservation over. The turn ends when the engine says it is
done, when its connection closes, or after ``hold_s``.

Tensor-parallel groups: each rank of a TP group asks for its own GPU's turn, and the
group's collective set-up runs inside the turns, so a rank that held its turn while its
peer waited behind another group's rank on the peer's GPU would wait for ever (two TP=2
engines on the same two GPUs, each holding one). A group's ranks therefore wait, off every
queue, until all of them have asked; then they join their GPUs' queues at the same moment,
and a group gets its turns only all at once, when each of its ranks is first in its GPU's
queue and that GPU is free and has room. Every queue keeps the one order in which groups
became complete, so the oldest waiter is first in all its queues and always gets through:
no deadlock. A rank that leaves breaks its group: the others are refused at once.

:class:`StartupTurns` keeps each GPU's queue and turn in its
:class:`~kvshare.deviceplugin.broker.records.GpuRecord`; the books call it and then serve the
GPU (a released reservation is memory for the waiters).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvshare.api.wire import Hello, TurnGranted, TurnRefused, TurnRequest
from kvshare.deviceplugin.broker.records import GpuRecord, Send, Turn, TurnWaiter, size

__all__ = ["StartupTurns"]

log = logging.getLogger(__name__)


def _group_key(request: TurnRequest) -> tuple[str, str]:
    """A tensor-parallel group: its pod's UID and its name."""
    return (request.pod_uid, request.group)


@dataclass(frozen=True)
class _Member:
    """One rank of a tensor-parallel group, waiting for its GPU's turn."""

    gpu: GpuRecord
    waiter: TurnWaiter


class StartupTurns:
    """The start-up turn of every GPU (see the module doc). Not thread-safe: used under
    the books' caller's lock."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        # Tensor-parallel groups by pod and name: ranks that have asked, until the group's
        # turns are given (then each rank's turn is its own GPU's, like any other). The pod
        # is part of the key so that a rank of another pod can neither join a group nor
        # break it (under Kubernetes the broker has verified the pod of every request).
        self._groups: dict[tuple[str, str], dict[int, _Member]] = {}

    @staticmethod
    def refusal(gpu: GpuRecord, request: TurnRequest) -> str | None:
        """Why ``request`` may not queue for ``gpu``'s turn, fit aside (None: it may)."""
        if gpu.draining or not gpu.healthy:
            state = "draining" if gpu.draining else "unhealthy"
            return f"GPU {gpu.info.index} is {state}: it takes no new engines"
        if min(request.static, request.kv_min) < 0:
            return "static and kv min must be >= 0"
        if request.group_size < 1 or not 0 <= request.rank < max(request.group_size, 1):
            return (
                f"rank {request.rank} of a group of {request.group_size}: need a group size "
                ">= 1 and 0 <= rank < group size"
            )
        if request.group_size > 1 and not request.group:
            return "a tensor-parallel rank needs the name of its group"
        return None

    def enqueue(
        self, gpu: GpuRecord, key: int, request: TurnRequest, pid: int, now: float
    ) -> tuple[list[GpuRecord], str | None]:
        """Queue connection ``key`` for ``gpu``'s turn; a group's rank waits for its peers.
        Returns the GPUs whose queues changed, or why the request is refused."""
        waiter = TurnWaiter(key=key, request=request, pid=pid, since=now)
        if request.group_size == 1:
            gpu.queue.append(waiter)
            return [gpu], None
        members = self._groups.setdefault(_group_key(request), {})
        first = next(iter(members.values()), None)
        if first is not None and first.waiter.request.group_size != request.group_size:
            return [], (
                f"group {request.group} has {first.waiter.request.group_size} ranks, not "
                f"{request.group_size}"
            )
        if request.rank in members:
            return [], f"rank {request.rank} of group {request.group} has asked already"
        if any(member.gpu is gpu for member in members.values()):
            return [], f"group {request.group} has a rank on GPU {gpu.info.index} already"
        members[request.rank] = _Member(gpu, waiter)
        gpu.forming += 1
        if len(members) < request.group_size:
            return [], None  # its peers have not asked yet
        for member in members.values():  # every rank joins its queue at the same moment
            member.gpu.forming -= 1
            member.gpu.queue.append(member.waiter)
        log.info(
            "start-up turns: group %s complete, its %d ranks queue", request.group, len(members)
        )
        return [member.gpu for member in members.values()], None

    def advance(self, gpu: GpuRecord, now: float) -> list[Send]:
        """Give the turn to the head of the queue if the GPU has room for it — for a
        group's rank, to every rank of the group at once, or to none."""
        if gpu.turn is not None or not gpu.queue:
            return []
        head = gpu.queue[0]
        if head.request.group_size > 1:
            return self._advance_group(_group_key(head.request), now)
        if gpu.unleased < head.request.static + head.request.kv_min:
            return []
        gpu.queue.popleft()
        return [self._grant(gpu, head, now)]

    def _advance_group(self, group: tuple[str, str], now: float) -> list[Send]:
        members = list(self._groups[group].values())
        for member in members:
            ready = member.gpu.turn is None and member.gpu.queue[0] is member.waiter
            need = member.waiter.request.static + member.waiter.request.kv_min
            if not ready or member.gpu.unleased < need:
                return []
        del self._groups[group]
        sends = []
        for member in members:
            member.gpu.queue.popleft()
            sends.append(self._grant(member.gpu, member.waiter, now))
        return sends

    def _grant(self, gpu: GpuRecord, head: TurnWaiter, now: float) -> Send:
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
        granted = TurnGranted(
            seq=head.request.seq, hold_s=self.hold_s, gpu_total=gpu.info.total_bytes
        )
        return Send("turn", head.key, granted)

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
        log.info("start-up turn on GPU %d back from pid %d", gpu.info.index, turn.waiter.pid)
        return True

    def withdraw(self, gpu: GpuRecord, key: int) -> list[Send] | None:
        """Connection ``key`` left ``gpu``'s queue or gave its turn back: ``None`` when it was
        not there, else the refusals of the group it broke, if any."""
        if gpu.turn is not None and gpu.turn.waiter.key == key:
            StartupTurns.release(gpu)
            return []
        for group, members in self._groups.items():
            for member in members.values():
                if member.gpu is gpu and member.waiter.key == key:
                    rank = member.waiter.request.rank
                    return self._break(group, f"rank {rank} of group {group[1]} left", key)
        for waiter in gpu.queue:
            if waiter.key == key:
                gpu.queue.remove(waiter)
                return []
        return None

    def _break(self, group: tuple[str, str], reason: str, leaving: int | None = None) -> list[Send]:
        """Take a group out of every queue and refuse its ranks (but the one ``leaving``)."""
        sends = []
        for member in self._groups.pop(group).values():
            if member.waiter in member.gpu.queue:
                member.gpu.queue.remove(member.waiter)
            else:
                member.gpu.forming -= 1
            if member.waiter.key == leaving:
                continue
            seq = member.waiter.request.seq
            sends.append(Send("turn", member.waiter.key, TurnRefused(seq, reason)))
        return sends

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

    def refuse_queued(self, gpu: GpuRecord, reason: str) -> list[Send]:
        """Refuse every engine still waiting for ``gpu``'s turn (a drain), and every group
        with a rank on it."""
        sends = []
        for group in [g for g, m in self._groups.items() if any(x.gpu is gpu for x in m.values())]:
            sends += self._break(group, reason)
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
