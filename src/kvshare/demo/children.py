"""The demo's child processes: spawned with their log, read line by line, stopped in order.

Every process the orchestrator starts (node agents, model servers) is a :class:`Child`:
it gets SIGTERM when the orchestrator dies, writes its log to a file, and is stopped by
asking first (closing its stdin, or SIGTERM), then terminating, then killing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["Child", "Children", "DemoError", "child_env", "read_lines", "spawn", "stop_all"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class DemoError(RuntimeError):
    """The demo could not run; the message says what failed and where its log is."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the orchestrator dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One started process, its name in messages and its log file."""

    name: str
    process: subprocess.Popen[str]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` of its log ("" when there is none)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def request_stop(self) -> None:
        """Ask the process to finish: close its stdin (servers) or SIGTERM (the agent)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        elif self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        """Wait for the process until ``deadline``, then terminate it, then kill it."""
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; terminating it", self.name)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stop_all(children: Sequence[Child], timeout_s: float = 30.0) -> None:
    """Stop every child, all at once (each is asked, then each is waited for)."""
    for child in children:
        child.request_stop()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.wait_stopped(deadline)


def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str], *, pipes: bool) -> Child:
    """Start ``argv`` with its stderr (and, without ``pipes``, its stdout) in ``log_path``;
    with ``pipes`` its stdin and stdout are the orchestrator's link to it."""
    log_file = log_path.open("w", encoding="utf-8")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else log_file,
            stderr=log_file,
            env=env,
            text=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call, no locks
        )
    finally:
        log_file.close()
    return Child(name, process, log_path)


def read_lines(key: tuple[str, int], stream: IO[str], out: queue.Queue[Any]) -> None:
    """Reader thread: one per server; puts ``(key, message)`` and ``(key, None)`` at EOF."""
    for line in stream:
        try:
            out.put((key, json.loads(line)))
        except json.JSONDecodeError:
            out.put((key, {"kind": "error", "message": f"unreadable line {line[:200]!r}"}))
    out.put((key, None))


def child_env() -> dict[str, str]:
    """The environment of every child: the caller's settings (log level, paths), this
    source tree first on the path, unbuffered output."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Children:
    """The node agents and the servers of one run, stopped servers first (so they leave
    their brokers cleanly), then the agents."""

    agents: list[Child] = field(default_factory=list)
    servers: list[Child] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def running(cls) -> Iterator[Children]:
        """Children started inside are all stopped on the way out."""
        children = cls()
        try:
            yield children
        finally:
            stop_all(children.servers)
            stop_all(children.agents)
