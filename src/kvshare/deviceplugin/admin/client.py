"""The admin socket's client: what ``kvshare ctl`` and ``kvshare top`` use to ask the node
agent. The requests, and how the broker executes them, are in
:mod:`kvshare.deviceplugin.broker.connections.admin_requests`.
"""

from __future__ import annotations

import socket

from kvshare.api.wire import FrameReader, ProtocolError
from kvshare.deviceplugin.broker.connections.admin_requests import (
    ADMIN_CODEC,
    AdminReply,
    AdminRequest,
)
from kvshare.deviceplugin.broker.views import BooksView

__all__ = ["AdminClient", "AdminError"]


class AdminError(RuntimeError):
    """The admin request failed; the message says why."""


class AdminClient:
    """Talks to the node agent's admin socket (one request per connection)."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self._path = path
        self._timeout = timeout

    def request(self, request: AdminRequest) -> BooksView:
        """Send ``request``; the books after it, or :class:`AdminError`."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self._timeout)
                sock.connect(self._path)
                sock.sendall(ADMIN_CODEC.encode(request))
                reply = self._read_reply(sock)
        except FileNotFoundError:
            raise AdminError(
                f"no admin socket at {self._path}: is `kvshare node` running here? "
                "(pass --admin-socket to point elsewhere)"
            ) from None
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise AdminError(f"admin socket {self._path}: {exc}") from None
        if not reply.ok or reply.view is None:
            raise AdminError(reply.error or "the node agent refused the request")
        return reply.view

    @staticmethod
    def _read_reply(sock: socket.socket) -> AdminReply:
        reader = FrameReader(ADMIN_CODEC.max_frame_bytes)
        while True:
            data = sock.recv(1 << 16)
            if not data:
                raise AdminError("the node agent closed the admin connection without a reply")
            for payload in reader.feed(data)[:1]:
                try:
                    return ADMIN_CODEC.decode_as(payload, AdminReply)
                except ProtocolError as exc:
                    raise AdminError(f"unexpected reply from the node agent: {exc}") from None
