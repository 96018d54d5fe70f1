"""Messages between the owner of a coordinated tensor-parallel group and its ranks.

Each rank listens on its own unix socket (:func:`rank_socket_path`), in Linux's abstract
namespace: no file on disk, so a rank that dies (SIGTERM before its pools close, SIGKILL)
leaves nothing behind and a new rank can take the name at once. The owner connects to
every rank; a rank serves only an owner running as its own user (``SO_PEERCRED``), as a
file mode of 0600 would. A frame is a 4-byte big-endian length and a UTF-8 JSON object, at most
:data:`MAX_FRAME` bytes. Requests carry an ``id`` and get exactly one reply with the same
``id``: ``{"id", "ok": true, ...}`` or ``{"id", "ok": false, "kind", "message"}``.
Notifications have no ``id`` and no reply (``want``/``report`` to a rank, ``limit`` from a
rank). Anything else is a :class:`ProtocolError` and ends that connection.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from typing import Any

from kvshare.runtime.errors import PeerError, PoolError

__all__ = [
    "MAX_FRAME",
    "ProtocolError",
    "peer_uid",
    "rank_socket_path",
    "read_frame",
    "write_frame",
]

MAX_FRAME = 1 << 20
_HEADER = struct.Struct("!I")
_GROUP = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_UNIX_PATH_MAX = 107

#: Requests an owner sends: each names a batch of page ids.
PAGE_OPS = ("create", "map", "unmap", "release")


class ProtocolError(PeerError):
    """A peer sent a frame that is not a valid message."""


def rank_socket_path(group: str, rank: int, namespace: str | None = None) -> str:
    """The abstract unix socket address (a leading NUL) rank ``rank`` of ``group`` listens
    on; ``namespace`` keeps groups of separate runs apart (tests)."""
    if not _GROUP.match(group):
        raise PoolError(
            f"tensor-parallel group name {group!r} must be 1-64 letters, digits, '.', '_' or '-'"
        )
    prefix = f"{namespace}/" if namespace else ""
    address = f"\0{prefix}kvshare-{group}-r{rank}"
    if len(address.encode()) > _UNIX_PATH_MAX:
        raise PoolError(
            f"socket address {address[1:]!r} is longer than a unix socket allows "
            f"({_UNIX_PATH_MAX} bytes); use a shorter namespace or group name"
        )
    return address


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def write_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message (the caller serialises writers)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes is over the {MAX_FRAME} byte limit")
    sock.sendall(_HEADER.pack(len(body)) + body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            if chunks:
                raise ProtocolError("the connection closed in the middle of a frame")
            return None
        chunks += chunk
    return bytes(chunks)


def read_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or ``None`` when the peer closed the connection cleanly."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes is over the {MAX_FRAME} byte limit")
    body = _read_exactly(sock, size)
    if body is None:
        raise ProtocolError("the connection closed in the middle of a frame")
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message
