"""Coordinated ownership: one owner decides, every rank maps the same pages on its device.

The owner (vLLM's scheduler, which may hold no KV memory itself) builds its pool with
``backend=None`` and a :class:`CoordinatedOwnership`; every rank runs a
:class:`~kvshare.runtime.rank_server.RankServer`. Each page operation of the owner's pool
goes to every rank at once and waits for all of them, each with a timeout:

- a rank that fails for lack of device memory (or at the kernel's mapping limit) makes the
  operation fail on all ranks: the ranks that succeeded are rolled back, and the pool
  answers the engine with ``Exhausted``;
- a rank that fails otherwise, does not answer in time, or goes away is a
  :class:`~kvshare.runtime.errors.PeerError` to the caller, and the pool refuses further
  work: its ranks are no longer in step, which is never silently dropped.

An owner that is itself one of the ranks runs a ``RankServer`` in its own process and
connects to it like to any other rank.

Leases: each rank holds the lease of its own GPU and forwards it.
:meth:`CoordinatedOwnership.group_lease` is the owner pool's lease: its limit is the smallest
rank lease (every rank holds the same pages); wants and usage reports go to every rank.

Threads: one reader thread per rank connection delivers replies and lease changes.
``_RankLink._lock`` guards a link's pending requests and its state; ``_send_lock`` its writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.errors import (
    MapCountExceededError,
    OutOfDeviceMemoryError,
    PeerError,
    PoolError,
)
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage
from kvshare.runtime.ownership import Ownership
from kvshare.runtime.pages import PageMapper
from kvshare.runtime.peer_protocol import ProtocolError, rank_socket_path, read_frame, write_frame

if TYPE_CHECKING:
    import torch

__all__ = ["CoordinatedOwnership", "GroupLease"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class _Pending:
    """One request waiting for its reply."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None
        self.error: PeerError | None = None


class _RankLink:
    """The owner's connection to one rank."""

    def __init__(
        self,
        rank: int,
        path: str,
        timeout_s: float,
        connect_timeout_s: float,
        on_limit: Callable[[int, int], None],
    ) -> None:
        self.rank = rank
        self.path = path
        self.timeout_s = timeout_s
        self._on_limit = on_limit
        self.on_dead: Callable[[PeerError], None] | None = None
        self._lock = threading.Lock()  # guards _pending, _dead, _closing
        self._send_lock = threading.Lock()  # serialises writes to _sock
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._dead: PeerError | None = None
        self._closing = False
        self._sock = self._connect(connect_timeout_s)
        self._reader = threading.Thread(
            target=self._read_loop, name=f"kvshare-owner-rank-{rank}", daemon=True
        )
        self._reader.start()

    def _connect(self, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise PeerError(
                        f"rank {self.rank} is not listening on @{self.path[1:]} after "
                        f"{timeout_s:g} s ({exc.strerror}); start every rank's RankServer "
                        "before the owner's pool"
                    ) from None
                time.sleep(0.05)
            else:
                return sock

    # --- requests ---------------------------------------------------------------------------

    def start(self, op: str, **fields: Any) -> _Pending:
        """Send a request; its reply is waited for with :meth:`finish`."""
        pending = _Pending(op)
        with self._lock:
            if self._dead is not None:
                pending.error = self._dead
                pending.done.set()
                return pending
            request_id = next(self._ids)
            self._pending[request_id] = pending
        try:
            with self._send_lock:
                write_frame(self._sock, {"id": request_id, "op": op, **fields})
        except OSError as exc:
            self._die(f"sending {op!r} failed: {exc}")
        return pending

    def finish(self, pending: _Pending) -> dict[str, Any]:
        """The reply of ``pending``; :class:`PeerError` when the rank failed or timed out."""
        if not pending.done.wait(self.timeout_s):
            self._die(f"no answer to {pending.op!r} within {self.timeout_s:g} s")
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None
        return pending.reply

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for its reply."""
        return self.finish(self.start(op, **fields))

    def notify(self, op: str, **fields: Any) -> None:
        """Send a notification (no reply); a dead link drops it (its death was reported)."""
        with self._lock:
            if self._dead is not None:
                return
        try:
            with self._send_lock:
                write_frame(self._sock, {"op": op, **fields})
        except OSError as exc:
            self._die(f"sending {op!r} failed: {exc}")

    # --- the reader thread -------------------------------------------------------------------

    def _read_loop(self) -> None:
        reason = "the rank closed the connection"
        try:
            while True:
                message = read_frame(self._sock)
                if message is None:
                    break
                if message.get("op") == "limit":
                    self._on_limit(self.rank, int(message["bytes"]))
                    continue
                with self._lock:
                    pending = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
                if pending is None:
                    raise ProtocolError(f"unexpected message {message!r}")
                pending.reply = message
                pending.done.set()
        except (OSError, ProtocolError, KeyError, ValueError, TypeError) as exc:
            reason = f"connection failed: {exc}"
        self._die(reason)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = PeerError(f"rank {self.rank} (@{self.path[1:]}): {reason}")
            pending, self._pending = list(self._pending.values()), {}
            closing = self._closing
        for waiter in pending:
            waiter.error = self._dead
            waiter.done.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if not closing:
            log.error("%s", self._dead)
            if self.on_dead is not None:
                self.on_dead(self._dead)

    def close(self) -> None:
        with self._lock:
            self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=10)
        self._sock.close()


def _raise_reply(rank: int, reply: dict[str, Any]) -> None:
    """Turn a failed reply into its exception."""
    if reply.get("ok"):
        return
    message = f"rank {rank}: {reply.get('message', 'failed')}"
    kind = reply.get("kind")
    if kind == "oom":
        raise OutOfDeviceMemoryError(message)
    if kind == "map_limit":
        raise MapCountExceededError(message)
    if kind == "config":
        raise PoolError(message)
    raise PeerError(message)


class GroupLease(LeaseSource):
    """The owner pool's lease: the smallest lease among the ranks, which grant it."""

    def __init__(self, links: list[_RankLink], world_size: int) -> None:
        self._links = links  # the owner's list, filled as the ranks connect
        self._world_size = world_size
        self._lock = threading.Lock()  # guards _limits and _holder
        self._limits: dict[int, int] = {}
        self._holder: LeaseHolder | None = None

    def rank_limit(self, rank: int, limit: int) -> None:
        """Rank ``rank`` holds a lease of ``limit`` bytes now."""
        with self._lock:
            before = self._smallest()
            self._limits[rank] = limit
            after = self._smallest()
            holder = self._holder
        if holder is not None and after != before:
            holder.lease_changed(after)

    def _smallest(self) -> int:
        if len(self._limits) < self._world_size:
            return 0
        return min(self._limits.values())

    def attach(self, holder: LeaseHolder) -> None:
        with self._lock:
            self._holder = holder

    def limit(self) -> int:
        with self._lock:
            return self._smallest()

    def want(self, total_bytes: int) -> None:
        for link in self._links:
            link.notify("want", bytes=total_bytes)

    def report(self, usage: PoolUsage) -> None:
        for link in self._links:
            link.notify("report", usage=dataclasses.asdict(usage))


class _CoordinatedMapper:
    """Page operations broadcast to every rank, all or nothing."""

    def __init__(self, ownership: CoordinatedOwnership) -> None:
        self._ownership = ownership
        self._links = ownership.links

    def _broadcast(self, op: str, pages: Sequence[int]) -> list[tuple[int, dict[str, Any]]]:
        """Send ``op`` to every rank; their replies. A dead or silent rank raises PeerError."""
        started = [(link, link.start(op, pages=list(pages))) for link in self._links]
        return [(link.rank, link.finish(pending)) for link, pending in started]

    def _all_or_nothing(self, op: str, undo: str, pages: Sequence[int]) -> None:
        replies = self._broadcast(op, pages)
        failed = [(rank, reply) for rank, reply in replies if not reply.get("ok")]
        if not failed:
            return
        succeeded = [rank for rank, reply in replies if reply.get("ok")]
        for rank in succeeded:
            _raise_reply(rank, self._links_by_rank(rank).request(undo, pages=list(pages)))
        _raise_reply(*failed[0])

    def _links_by_rank(self, rank: int) -> _RankLink:
        return next(link for link in self._links if link.rank == rank)

    def _everywhere(self, op: str, pages: Sequence[int]) -> None:
        for rank, reply in self._broadcast(op, pages):
            if not reply.get("ok"):  # the ranks are out of step now
                raise PeerError(f"rank {rank}: {op} failed: {reply.get('message')}")

    def create(self, pages: Sequence[int]) -> None:
        self._all_or_nothing("create", "release", pages)

    def map(self, pages: Sequence[int]) -> None:
        self._all_or_nothing("map", "unmap", pages)

    def unmap(self, pages: Sequence[int]) -> None:
        self._everywhere("unmap", pages)

    def release(self, pages: Sequence[int]) -> None:
        self._everywhere("release", pages)

    def tensor(self, first: int, count: int) -> torch.Tensor:
        raise PoolError(
            "the owner of a coordinated group holds no KV memory: each rank's tensors come "
            "from its RankServer.tensor()"
        )

    def block_address(self, buffer: int, block: int) -> int:
        raise PoolError(
            "the owner of a coordinated group holds no KV memory: each rank's blocks are "
            "in its RankServer's pool"
        )

    def close(self) -> None:
        self._ownership.close()


class CoordinatedOwnership(Ownership):
    """The owner of a coordinated group: connects to ranks ``0..world_size-1`` of ``group``.

    Connecting waits up to ``connect_timeout_s`` for every rank to listen; every request
    then waits up to ``timeout_s`` for every rank's answer.
    """

    mode = "coordinated"

    def __init__(
        self,
        group: str,
        world_size: int,
        *,
        namespace: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if world_size < 1:
            raise PoolError(f"a coordinated group needs world_size >= 1, not {world_size}")
        self.group = group
        self.rank = None
        self.world_size = world_size
        self.links: list[_RankLink] = []
        self._lease = GroupLease(self.links, world_size)
        self._closed = False
        paths = [rank_socket_path(group, rank, namespace) for rank in range(world_size)]
        try:
            for rank, path in enumerate(paths):
                self.links.append(
                    _RankLink(rank, path, timeout_s, connect_timeout_s, self._lease.rank_limit)
                )
            for link in self.links:
                link_limit = self._hello(link, None)
                self._lease.rank_limit(link.rank, link_limit)
        except BaseException:
            self.close()
            raise

    def _hello(self, link: _RankLink, geometry: KVGeometry | None) -> int:
        fields: dict[str, Any] = {"world_size": self.world_size}
        if geometry is not None:
            fields["geometry"] = dataclasses.asdict(geometry)
        reply = link.request("hello", **fields)
        _raise_reply(link.rank, reply)
        if reply.get("rank") != link.rank:
            raise PoolError(
                f"{link.path} answered as rank {reply.get('rank')}, expected rank {link.rank}"
            )
        return int(reply.get("limit") or 0)

    def group_lease(self) -> GroupLease:
        """The lease the owner's pool uses: the smallest of the ranks' leases."""
        return self._lease

    def open_mapper(
        self,
        geometry: KVGeometry,
        backend: Backend | None,
        on_failure: Callable[[PeerError], None],
    ) -> PageMapper:
        if backend is not None:
            raise PoolError(
                "the owner of a coordinated group maps pages through its ranks and takes no "
                "backend; an owner that holds KV memory runs a RankServer for its own rank"
            )
        for link in self.links:
            self._hello(link, geometry)
            link.on_dead = on_failure
        return _CoordinatedMapper(self)

    def close(self) -> None:
        """Disconnect from every rank (each then releases its pages). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in self.links:
            link.close()

    def __repr__(self) -> str:
        return f"CoordinatedOwnership(group={self.group!r}, world_size={self.world_size})"
