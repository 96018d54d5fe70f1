"""Real processes for the node agent's tests: ``kvshare node`` itself, and pool
processes that lease real memory from it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from kvshare.deviceplugin.admin.client import AdminClient, AdminError
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.deviceplugin.broker.views import BooksView, PoolView
from kvshare.deviceplugin.inventory import parse_fake_gpus
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MIB = 2**20


def check_engines_take_turns(
    agent: AgentProcess, turn: Callable[[], AbstractContextManager[object]], static_bytes: int
) -> None:
    """Two engines start through ``turn`` on the agent's first GPU at once: the second
    waits until the first is done, and the holder's static memory stays reserved."""
    events: list[str] = []
    first_in = threading.Event()
    let_go = threading.Event()

    def start(name: str, hold: bool) -> None:
        with turn():
            events.append(f"{name} starts")
            if hold:
                first_in.set()
                let_go.wait(60)
            events.append(f"{name} done")

    first = threading.Thread(target=start, args=("first", True))
    first.start()
    assert first_in.wait(60)
    second = threading.Thread(target=start, args=("second", False))
    second.start()
    wait_until(lambda: agent.view().gpus[0].turn_waiting == 1, what="the second engine to queue")
    assert agent.view().gpus[0].static == static_bytes  # the holder's room is reserved
    let_go.set()
    first.join(60)
    second.join(60)
    assert events == ["first starts", "first done", "second starts", "second done"]


def kvshare_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvshare ARGS...`` (ctl, top) as a user would, and wait for it."""
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for unix sockets (paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class AgentProcess:
    """``kvshare node`` with fake GPUs, sockets in a temp dir, no kubelet, no cluster."""

    def __init__(
        self,
        directory: Path,
        fake_gpus: str | None,
        extra: list[str],
        *,
        node_name: str = "test-node",
        kubeconfig: Path | None = None,
        wrapper: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """``fake_gpus`` None: the GPUs come from the node's configuration (``--config``);
        ``kubeconfig`` None: no Kubernetes API; ``wrapper``: a command the agent runs
        under (e.g. ``prlimit``: no code runs between fork and exec in this threaded
        process)."""
        self.directory = directory
        # The directory pods would mount holds the broker socket only; the admin
        # directory is apart from it, as the node agent requires.
        self.broker_socket = directory / "run" / "broker.sock"
        self.admin_socket = directory / "admin" / "admin.sock"
        self.gpus = parse_fake_gpus(fake_gpus, node_name) if fake_gpus else []
        kube = ["--kubeconfig", str(kubeconfig)] if kubeconfig else ["--no-kube"]
        self._args = [
            *wrapper,
            sys.executable, "-m", "kvshare.cli", "node",
            *(["--fake-gpus", fake_gpus] if fake_gpus else []),
            "--node-name", node_name,
            "--broker-socket", str(self.broker_socket),
            "--admin-dir", str(directory / "admin"),
            "--device-plugin-dir", str(directory / "no-kubelet"),
            "--metrics-address", "127.0.0.1:0",
            *kube,
            *extra,
        ]  # fmt: skip
        self.process: subprocess.Popen[str] | None = None
        self.log: list[str] = []
        self.metrics_port = 0
        self._env = env

    def start(self) -> None:
        self.launch()
        wait_until(self._started, 60, "kvshare node to start")

    def launch(self) -> None:
        """Start the process and collect its log, without waiting for it to serve."""
        self.log = []
        self.metrics_port = 0
        self.process = subprocess.Popen(
            self._args,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=self._env,
        )
        threading.Thread(target=self._collect, args=(self.process,), daemon=True).start()

    def _collect(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self.log.append(line)
            match = re.search(r"metrics http://127\.0\.0\.1:(\d+)/metrics", line)
            if match:
                self.metrics_port = int(match.group(1))

    def _started(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"kvshare node exited {self.process.returncode}:\n{''.join(self.log)}")
        return self.metrics_port > 0

    def view(self) -> BooksView:
        return AdminClient(str(self.admin_socket)).request(AdminRequest(op="list"))

    def admin(self, request: AdminRequest) -> BooksView:
        return AdminClient(str(self.admin_socket)).request(request)

    def pools(self) -> dict[str, PoolView]:
        return {p.name: p for p in self.view().pools}

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=30)

    def try_view(self) -> BooksView | None:
        try:
            return self.view()
        except AdminError:
            return None


@pytest.fixture
def agent_factory(short_tmp: Path) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def make(fake_gpus: str = "1x8Gi", *extra: str) -> AgentProcess:
        agent = AgentProcess(short_tmp, fake_gpus, list(extra))
        agent.start()
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        if agent.process is not None and agent.process.poll() is None:
            agent.stop(signal.SIGKILL)


class PoolProcess:
    """A worker process (``kv_pool_proc.py``): a real KVPool leasing from the broker."""

    def __init__(self, args: list[str], preexec_fn: Callable[[], None] | None = None) -> None:
        """``preexec_fn`` runs in the child before the worker starts (e.g. to enter a pod)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.deviceplugin.kv_pool_proc", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - it only joins a cgroup and a namespace
        )
        hello = self._read()
        if "error" in hello:
            self.error: str | None = hello["error"]
            return
        self.error = None
        self.name: str = hello["name"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            stderr = self.process.stderr.read() if self.process.stderr else ""
            pytest.fail(f"pool process {self.process.pid} died ({self.process.wait()}): {stderr}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def status(self) -> dict[str, Any]:
        return self.send(cmd="status")

    def demand(self, nbytes: int) -> dict[str, Any]:
        return self.send(cmd="demand", bytes=nbytes)

    def exit(self) -> None:
        self.send(cmd="exit")
        self.process.wait(timeout=30)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@pytest.fixture
def pool_factory() -> Iterator[Callable[..., PoolProcess]]:
    pools: list[PoolProcess] = []

    def make(agent: AgentProcess, pod: str, **options: float) -> PoolProcess:
        args = ["--socket", str(agent.broker_socket), "--gpu", agent.gpus[0].uuid, "--pod", pod]
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        pool = PoolProcess(args)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        if pool.process.poll() is None:
            pool.process.kill()
            pool.process.wait(timeout=30)
