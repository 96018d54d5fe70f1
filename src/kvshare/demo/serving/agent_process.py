"""``kvshare node`` as a process that tests and benchmarks stop, freeze, kill and restart.

One fake GPU; the broker socket, and the admin socket and restart file, in two folders of
one directory (so a restarted agent finds its predecessor's pools); ``/metrics`` and
``/readyz`` on one loopback port that stays the same across restarts; the log of every run
appended to one file. The agent is reached only through its real interfaces: the admin
socket (the books, as ``kvshare ctl`` sees them) and its HTTP endpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvshare.deviceplugin.admin.client import AdminClient, AdminError
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.deviceplugin.broker.views import BooksView
from kvshare.deviceplugin.inventory import parse_fake_gpus

__all__ = ["AgentError", "NodeAgentProcess"]

MIB = 2**20
NODE_NAME = "kvshare-serving"


class AgentError(RuntimeError):
    """The agent did not start or answer; the message carries its log's last lines."""


def _free_port() -> int:
    from kvshare.demo.serving.vllm_server import free_port

    return free_port()


class NodeAgentProcess:
    """``kvshare node --fake-gpus 1x<gpu>`` with ``--headroom``, restartable with others."""

    def __init__(
        self,
        directory: Path,
        log_path: Path,
        *,
        gpu_bytes: int,
        headroom: int,
        args: Sequence[str] = (),
    ) -> None:
        self.directory = directory
        self.log_path = log_path
        # The admin directory apart from the one pods mount, as the agent requires.
        self.broker_socket = directory / "pods" / "broker.sock"
        self.admin_dir = directory / "agent"
        self.admin_socket = self.admin_dir / "admin.sock"
        self.gpu_bytes = gpu_bytes
        self.headroom = headroom
        self.args = list(args)
        self.port = _free_port()
        self.gpu_uuid = parse_fake_gpus(f"1x{gpu_bytes // MIB}Mi", NODE_NAME)[0].uuid
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def budget(self) -> int:
        """What the broker lends with the current settings (no static footprints)."""
        return self.gpu_bytes - self.headroom

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        """The command line of the next start."""
        return [
            sys.executable, "-m", "kvshare.cli", "node",
            "--fake-gpus", f"1x{self.gpu_bytes // MIB}Mi",
            "--headroom", f"{self.headroom // MIB}Mi",
            "--node-name", NODE_NAME,
            "--broker-socket", str(self.broker_socket),
            "--admin-dir", str(self.admin_dir),
            "--device-plugin-dir", str(self.directory / "no-kubelet"),
            "--metrics-address", f"127.0.0.1:{self.port}",
            "--no-kube",
            *self.args,
        ]  # fmt: skip

    def start(
        self,
        *,
        gpu_bytes: int | None = None,
        headroom: int | None = None,
        timeout_s: float = 60.0,
    ) -> float:
        """Start the agent (again: with the restart file of the previous run), with another
        GPU size or headroom if given; returns once its admin socket answers, with the
        seconds that took."""
        if self.running():
            raise AgentError("the node agent is already running")
        self.gpu_bytes = gpu_bytes or self.gpu_bytes
        self.headroom = self.headroom if headroom is None else headroom
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- {' '.join(self.argv()[3:])}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.started_at = time.monotonic()
        deadline = self.started_at + timeout_s
        while self.try_view() is None:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise AgentError(f"kvshare node exited {code}:\n{self.tail()}")
            if time.monotonic() > deadline:
                waited = f"{timeout_s:.0f} s"
                raise AgentError(f"kvshare node did not answer in {waited}:\n{self.tail()}")
            time.sleep(0.05)
        return time.monotonic() - self.started_at

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _signal(self, signum: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signum)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, as Kubernetes stops a pod (SIGKILL after ``timeout_s``)."""
        if self.process is None:
            return
        self._signal(signal.SIGCONT)  # a frozen agent cannot act on SIGTERM
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (an OOM kill, a node hiccup); sockets and the restart file stay."""
        if self.process is not None:
            self._signal(signal.SIGKILL)
            self.process.wait(30)

    def pause(self) -> None:
        """SIGSTOP: every thread of the agent stops, its sockets stay open."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self._signal(signal.SIGCONT)

    # --- its interfaces ---------------------------------------------------------------------

    def view(self, timeout_s: float = 30.0) -> BooksView:
        """The books, from the admin socket (:class:`AdminError` when it does not answer)."""
        return AdminClient(str(self.admin_socket), timeout=timeout_s).request(
            AdminRequest(op="list")
        )

    def try_view(self, timeout_s: float = 2.0) -> BooksView | None:
        try:
            return self.view(timeout_s)
        except AdminError:
            return None

    def admin(self, request: AdminRequest) -> BooksView:
        return AdminClient(str(self.admin_socket)).request(request)

    def ready(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/readyz`` answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=timeout_s) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self, timeout_s: float = 5.0) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as answer:
            return str(answer.read().decode())

    def log_lines(self) -> list[str]:
        """Every line the agent logged, over all its runs."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_lines()[-lines:])
