"""Who is on the other end of a unix socket, and whether that process is still alive.

The broker binds each connection to the process that opened it (``SO_PEERCRED``, and the
pidfd the kernel hands out for that very process, ``SO_PEERPIDFD``), watches that
process through a pidfd so its lease returns the moment it exits, and reads which pod it
runs in from its cgroup (:func:`pod_of`): the kubelet puts every container of a pod
under a cgroup named after the pod's UID, and a container cannot move itself out of it.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "Peer",
    "PodOfProcess",
    "exited",
    "open_pidfd",
    "peer_of",
    "peer_pidfd",
    "pod_of",
    "pod_uid_in_cgroup",
    "process_start_time",
    "same_mount_namespace",
]

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")
#: ``SO_PEERPIDFD`` (Linux 6.5): a pidfd of the process that connected, not of whichever
#: process holds its pid now. Not in Python's socket module yet.
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
#: A pod's cgroup as the kubelet names it: ``pod<uid>`` (cgroupfs driver, with dashes) or
#: ``kubepods-<class>-pod<uid>.slice`` (systemd driver, with underscores).
_POD_CGROUP = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
    r"(?:\.slice)?(?=/|$)"
)


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


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd of the process that connected ``sock`` (``SO_PEERPIDFD``), or None where
    the kernel does not give one (before Linux 6.5)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
    except OSError:
        return None


def exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd turned readable)."""
    poller = select.poll()  # not select(): descriptors past 1023 are common here
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@dataclass(frozen=True)
class PodOfProcess:
    """Which pod a process runs in, as its cgroup tells: ``uid``, or why it cannot be told."""

    uid: str | None
    problem: str = ""


def pod_uid_in_cgroup(text: str) -> PodOfProcess:
    """The pod UID in the text of ``/proc/<pid>/cgroup``: one UID, or why not (no pod
    cgroup in it, or two different ones)."""
    found: set[str] = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if "kubepods" in path:
            found.update(m.group(1).replace("_", "-") for m in _POD_CGROUP.finditer(path))
    if not found:
        return PodOfProcess(None, "its cgroup names no pod (not a container of a pod)")
    if len(found) > 1:
        return PodOfProcess(None, f"its cgroups name {len(found)} different pods")
    return PodOfProcess(found.pop())


def pod_of(pid: int, pidfd: int | None) -> PodOfProcess:
    """Which pod process ``pid`` runs in. With its ``pidfd``, an answer read after the
    process exited (its pid may be another process's by then) is no answer."""
    if pid <= 0:
        return PodOfProcess(None, "it is not visible in the node agent's pid namespace")
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as cgroup:
            text = cgroup.read(1 << 16)
    except OSError as exc:
        return PodOfProcess(None, f"its cgroup cannot be read ({exc.strerror})")
    if pidfd is not None and exited(pidfd):
        return PodOfProcess(None, "it exited while it was being checked")
    return pod_uid_in_cgroup(text)


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


def same_mount_namespace(pid: int) -> bool | None:
    """Whether ``pid`` shares this process's mount namespace (None: cannot tell)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return None
