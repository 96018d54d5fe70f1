"""One accepted connection of the broker: its socket, its peer, what it is for, the frames
it has sent in part, and what waits to be written to it.

Touched by the broker's loop thread only (:mod:`kvshare.deviceplugin.broker.server`).
"""

from __future__ import annotations

import selectors
import socket
from typing import Literal

from kvshare.api.wire import MAX_REQUEST_BYTES, FrameReader, Hello, TurnRequest
from kvshare.deviceplugin.broker.peers import Peer
from kvshare.deviceplugin.broker.verification import Tenant

__all__ = ["MAX_OUTBOX_BYTES", "Conn", "Role"]

#: A peer that lets this much unsent data pile up is not reading: it is disconnected.
MAX_OUTBOX_BYTES = 1 << 20

#: What a connection is for: not yet said (``new``), said but waiting for its pod to be
#: known (``verifying``), a pool's, a start-up turn's, an admin request's, or done with.
Role = Literal["new", "verifying", "pool", "turn", "admin", "closed"]


class Conn:
    """One accepted connection (loop thread only)."""

    __slots__ = (
        "id",
        "out",
        "peer",
        "pending",
        "pool_id",
        "reader",
        "role",
        "sock",
        "tenant",
        "wait_until",
    )

    def __init__(
        self, conn_id: int, sock: socket.socket, peer: Peer, role: Role, tenant: Tenant
    ) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer = peer
        self.role: Role = role
        self.tenant = tenant
        self.reader = FrameReader(MAX_REQUEST_BYTES)
        self.out = bytearray()
        self.pool_id = 0
        self.pending: Hello | TurnRequest | None = None
        """The first message, while it waits for its pod to be known."""
        self.wait_until = 0.0

    def write(self, frame: bytes, selector: selectors.BaseSelector) -> bool:
        """Send ``frame``, queueing what the socket does not take now (and asking
        ``selector`` to say when it can); False when the socket failed."""
        if self.out:
            self.out += frame
            return True
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            return False
        if sent < len(frame):
            self.out += frame[sent:]
            selector.modify(
                self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("conn", self.id)
            )
        return True

    def flush(self, selector: selectors.BaseSelector) -> bool:
        """Send what is queued (the socket turned writable); False when the socket failed."""
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del self.out[:sent]
        if not self.out:
            selector.modify(self.sock, selectors.EVENT_READ, ("conn", self.id))
        return True

    def overflowing(self, frame_bytes: int) -> bool:
        """Whether the peer has let more pile up than it may (one admin reply, whose
        frame is ``frame_bytes`` long, may be more on its own)."""
        return len(self.out) > max(MAX_OUTBOX_BYTES, frame_bytes)
