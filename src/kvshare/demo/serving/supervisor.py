"""Runs one command and guarantees that its whole process tree ends with it.

``vllm serve`` starts an engine-core process, which starts the workers; when the API
server dies abruptly (SIGKILL, or its parent gone) they are orphaned and keep running
(a worker spins at a full core). :class:`~kvshare.demo.serving.vllm_server.VllmServer`
therefore starts ``python -m kvshare.demo.serving.supervisor COMMAND...``:

- the supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``): every orphan of the
  tree is re-parented to it, so it can find and end them, and it reaps them;
- SIGTERM (or SIGINT) is passed on to the command, as Kubernetes stops a container; after
  ``--grace`` seconds what is left of the tree gets SIGKILL;
- when the command exits, whatever it left behind gets SIGTERM, then SIGKILL;
- when the process that started the supervisor dies, the supervisor gets SIGTERM
  (``PR_SET_PDEATHSIG``) and does the above.

It exits with the command's status (128 + the signal when a signal ended it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Seconds between two collections of exited orphans while the command runs.
_REAP_INTERVAL_S = 1.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _processes() -> list[tuple[int, int, str, float]]:
    """(pid, parent pid, state, CPU seconds so far: user + system) of every process, from
    ``/proc``."""
    table = []
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces and parentheses: split after it.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
        table.append((int(entry.name), int(fields[1]), fields[0], cpu_s))
    return table


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which holds no memory or files, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in {"Z", "X"}


def _below(pid: int) -> list[tuple[int, int, float]]:
    """(pid, depth, CPU seconds so far) of every live process below ``pid``: depth 1 for
    its children, 2 for theirs, and so on."""
    children: dict[int, list[tuple[int, float]]] = {}
    for child, parent, state, cpu_s in _processes():
        if state not in {"Z", "X"}:
            children.setdefault(parent, []).append((child, cpu_s))
    found: list[tuple[int, int, float]] = []
    todo = [(pid, 0)]
    while todo:
        parent, depth = todo.pop()
        for child, cpu_s in children.get(parent, []):
            found.append((child, depth + 1, cpu_s))
            todo.append((child, depth + 1))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    return [child for child, _, _ in _below(pid)]


def cpu_by_depth(pid: int) -> dict[int, float]:
    """CPU seconds so far (user + system) of the live processes below ``pid``, summed by
    depth: 1 for its children, 2 for theirs, and so on."""
    found: dict[int, float] = {}
    for _, depth, cpu_s in _below(pid):
        found[depth] = found.get(depth, 0.0) + cpu_s
    return found


def lower_priority(pid: int, niceness: int) -> None:
    """Run the process group of ``pid`` (a tree this module supervises) at CPU
    ``niceness``. A tree in a session of its own gets its session's scheduling group niced
    too: where the kernel groups processes by session (``autogroup``, on by default;
    ``/proc/<pid>/autogroup``), a process's niceness weighs only against the other
    processes of its session, and such a tree would take a whole session's share of the
    cores from every other session, whatever its processes' niceness. A tree in the
    caller's session leaves the session's group alone: that would renice the caller."""
    os.setpriority(os.PRIO_PGRP, os.getpgid(pid), niceness)
    if os.getsid(pid) == pid:
        with contextlib.suppress(FileNotFoundError):
            Path(f"/proc/{pid}/autogroup").write_text(str(niceness))


def _reap(keep: int | None = None) -> None:
    """Collect this process's exited children (re-parented orphans included), except
    ``keep``, which ``Popen`` waits for."""
    me = os.getpid()
    for pid, parent, state, _ in _processes():
        if parent == me and state == "Z" and pid != keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _end_tree(signum: int) -> None:
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _drain(deadline: float) -> bool:
    """Reap until no process is left below this one or ``deadline``; whether none is."""
    while True:
        _reap()
        if not descendants(os.getpid()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def supervise(command: list[str], grace_s: float) -> int:
    """Run ``command`` (see the module doc); its exit status."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    child = subprocess.Popen(command)
    forwarded = False
    deadline = float("inf")
    next_reap = 0.0
    while child.poll() is None:
        if stopping and not forwarded:
            child.send_signal(stopping[0])
            forwarded = True
            deadline = time.monotonic() + grace_s
        if time.monotonic() > deadline:
            _end_tree(signal.SIGKILL)
        time.sleep(0.05)
        # Orphans are found by reading every process's stat: once a second is enough for
        # exited ones to be collected, and costs a server's idle hours nothing noticeable.
        if time.monotonic() >= next_reap:
            _reap(keep=child.pid)
            next_reap = time.monotonic() + _REAP_INTERVAL_S
    code = child.returncode
    # What the command left behind: asked to stop, then killed.
    _end_tree(signal.SIGTERM)
    if not _drain(time.monotonic() + min(grace_s, 10.0)):
        _end_tree(signal.SIGKILL)
        _drain(time.monotonic() + 10.0)
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return supervise(command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
