"""The broker's listening unix sockets: bound once, with a clear error when they cannot be,
and never over another live node agent's."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

__all__ = ["ListenError", "close", "drain", "listen"]


class ListenError(RuntimeError):
    """A socket cannot be bound; the message says what to change."""


def listen(path: Path, mode: int, kind: str) -> socket.socket:
    """A non-blocking socket listening at ``path`` with permissions ``mode``; a stale
    socket file left there is replaced, a live one is an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ListenError(
            f"cannot create {path.parent} for the {kind} socket ({exc.strerror}): "
            "choose a writable path (--broker-socket / KVSHARE_BROKER_SOCKET, --admin-socket)"
        ) from None
    if len(os.fsencode(path)) >= 108:
        raise ListenError(f"socket path {path} is too long for a unix socket (max 107 bytes)")
    if path.exists() or path.is_symlink():
        if stat.S_ISSOCK(path.lstat().st_mode) and _answers(path):
            raise ListenError(f"another node agent is already serving at {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, mode)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def close(sock: socket.socket, path: Path) -> None:
    """Stop listening on ``sock`` and remove its file at ``path``."""
    sock.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True


def drain(fd: int) -> None:
    """Read everything waiting on the non-blocking ``fd`` (the loop's wake-up pipe)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
