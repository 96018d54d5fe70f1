"""Who is on the other end of a unix socket, and whether that process is still alive.

The broker binds each connection to the process that opened it (``SO_PEERCRED``), watches
that process through a pidfd so its lease returns the moment it exits, and checks that a
process claiming to be a pod's worker really runs in that pod's cgroup.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "Peer",
    "in_pod",
    "open_pidfd",
    "peer_of",
    "process_start_time",
    "same_mount_namespace",
]

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    """Credentials of the process that connected (pid 0: not visible in our pid namespace)."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """The peer's credentials as the kernel recorded them at ``connect``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def open_pidfd(pid: int) -> int | None:
    """A pidfd that turns readable when ``pid`` exits; None when pidfds are unavailable.

    Raises :class:`ProcessLookupError` when the process is already gone.
    """
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (OSError, AttributeError) as exc:
        log.debug("no pidfd for pid %d (%s): relying on the socket alone", pid, exc)
        return None


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its end.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def in_pod(pid: int, pod_uid: str) -> bool | None:
    """Whether ``pid`` runs in the pod ``pod_uid``: True/False from its cgroup path, or
    None when that cannot be told (not under Kubernetes, or the cgroup is unreadable)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as cgroup:
            text = cgroup.read()
    except OSError:
        return None
    if "kubepods" not in text:
        return None
    # cgroupfs drivers write the uid with dashes, systemd drivers with underscores.
    return pod_uid in text or pod_uid.replace("-", "_") in text


def same_mount_namespace(pid: int) -> bool | None:
    """Whether ``pid`` shares this process's mount namespace (None: cannot tell)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return None
