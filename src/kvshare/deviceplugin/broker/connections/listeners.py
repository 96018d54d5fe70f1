"""The broker's listening sockets and the accept side of its loop: who a new connection
belongs to, whether its pod (and the node) may open another, and what happens when the
process runs out of file descriptors.

A connection that may not be opened is told why and closed at once, costing nothing
that lasts. Out of file descriptors, the listening sockets leave the selector for the
gate's back-off (the kernel keeps waiting connections in its backlog), so the loop does
not spin on a socket it cannot accept from, and one line per interval says so.

Touched by the broker's loop thread only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable
from pathlib import Path

from kvshare.api.wire import BROKER_CODEC, Refused
from kvshare.deviceplugin.broker import peers
from kvshare.deviceplugin.broker.connections import admin_requests, sockets
from kvshare.deviceplugin.broker.connections.conn import Conn
from kvshare.deviceplugin.broker.connections.gate import ADMIN, ConnectionGate
from kvshare.deviceplugin.broker.identity import Refusal
from kvshare.deviceplugin.broker.throttle import ThrottledLog
from kvshare.deviceplugin.broker.verification import Tenant, Verifier

__all__ = ["Listeners"]

log = logging.getLogger(__name__)

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Listeners:
    """The pool and admin sockets, and the connections accepted on them."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        gate: ConnectionGate,
        verifier: Verifier,
        refused: Callable[[int, Refusal], None],
    ) -> None:
        """``refused(pid, refusal)`` counts and logs a connection refused at once."""
        self._selector = selector
        self._gate = gate
        self._verifier = verifier
        self._refused = refused
        self._sockets: list[tuple[socket.socket, Path, str]] = []
        self._next_id = 1
        self._accepting = True
        self._log = ThrottledLog(
            log, "failed accepts", burst=1, interval_s=max(gate.limits.accept_backoff_s, 1.0)
        )

    def listen(self, path: Path, mode: int, kind: str) -> None:
        """Listen at ``path`` (permissions ``mode``) for ``kind`` connections ("pool" or
        "admin"); raises :class:`sockets.ListenError`."""
        sock = sockets.listen(path, mode, kind)
        self._selector.register(sock, selectors.EVENT_READ, ("listen", kind))
        self._sockets.append((sock, path, kind))

    def close(self) -> None:
        """Stop listening and remove the socket files."""
        for sock, path, _ in self._sockets:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sockets.close(sock, path)
        self._sockets.clear()

    def accept(self, listener: socket.socket, kind: str) -> list[Conn]:
        """Accept what waits on ``listener``: the connections opened (registered with
        the selector as ``("conn", id)``); those that may not be opened are refused."""
        opened: list[Conn] = []
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return opened
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._pause(exc)
                return opened
            sock.setblocking(False)
            try:
                peer = peers.peer_of(sock)
            except OSError:
                sock.close()
                continue
            tenant = self._tenant(sock, peer, kind)
            if isinstance(tenant, Tenant):
                problem = self._gate.refusal(tenant.key)
                if problem is None:
                    opened.append(self._open(sock, peer, kind, tenant))
                    continue
                tenant = Refusal("limit", problem)
            self._refused(peer.pid, tenant)
            answer = (
                admin_requests.ADMIN_CODEC.encode(
                    admin_requests.AdminReply(ok=False, error=tenant.message)
                )
                if kind == "admin"
                else BROKER_CODEC.encode(Refused(reason=tenant.message))
            )
            with contextlib.suppress(OSError):
                sock.send(answer)
            sock.close()

    def resume(self, now: float) -> None:
        """Poll the listening sockets again once the back-off is over."""
        self._log.flush()
        if self._accepting or self._gate.paused(now):
            return
        self._accepting = True
        for sock, _, kind in self._sockets:
            self._selector.register(sock, selectors.EVENT_READ, ("listen", kind))

    def _open(self, sock: socket.socket, peer: peers.Peer, kind: str, tenant: Tenant) -> Conn:
        conn = Conn(self._next_id, sock, peer, "admin" if kind == "admin" else "new", tenant)
        self._next_id += 1
        self._gate.opened(conn.id, tenant.key, time.monotonic())
        self._selector.register(sock, selectors.EVENT_READ, ("conn", conn.id))
        return conn

    def _tenant(self, sock: socket.socket, peer: peers.Peer, kind: str) -> Tenant | Refusal:
        """Whom a new connection belongs to (the admin socket's peers are checked on
        every request instead)."""
        if kind == "admin":
            return Tenant(ADMIN)
        pidfd = peers.peer_pidfd(sock)
        try:
            return self._verifier.tenant(peer, pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _pause(self, exc: OSError) -> None:
        self._gate.pause_accepting(time.monotonic())
        if self._accepting:
            self._accepting = False
            for sock, _, _ in self._sockets:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
        self._log.log(
            logging.ERROR,
            "broker: out of file descriptors (%s; %d connections open): not accepting for %.1f s",
            exc.strerror,
            self._gate.total,
            self._gate.limits.accept_backoff_s,
        )
