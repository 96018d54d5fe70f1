"""Start and stop one real ``vllm serve``, with kvshare or without, as a user would run it.

A :class:`VllmServer` runs the serving environment's own ``vllm serve`` command under a
:mod:`~kvshare.demo.serving.supervisor` in a process group of its own, with its log in a
file, and waits until the OpenAI API answers. With
``kvshare=True`` the engine gets kvshare the way a pod does: kvshare's ``sitecustomize`` on
``PYTHONPATH`` (the operator injects the runtime bundle; here the source tree's boot folder,
or any bundle given as ``runtime``), ``KVSHARE_ENABLE=1`` and the pool's ``KVSHARE_*``
settings; vLLM is given no KV cache size (the pool's virtual size is what it sizes for).
Without kvshare the server is plain vLLM, with the KV cache size it is given.

:meth:`VllmServer.stop` ends the whole process tree (API server, engine core, worker):
SIGTERM first, as Kubernetes does, then SIGKILL to what is left. :meth:`VllmServer.kill`
sends SIGKILL to the tree at once (a crash or an OOM kill).

Settings that make start-up quickest on CPU: ``--enforce-eager`` (no torch.compile; 19 s
against 47-52 s cold) and a ``VLLM_CACHE_ROOT`` shared by the servers of one run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvshare.demo.serving import supervisor
from kvshare.demo.serving.environment import (
    DEFAULT_SERVING,
    ServingEnvironment,
    checkout_root,
    tiny_model_dir,
)

__all__ = [
    "ServerError",
    "ServerOptions",
    "VllmServer",
    "alive",
    "descendants",
    "free_port",
    "kvshare_runtime_path",
]

log = logging.getLogger(__name__)

#: Name the servers give their model in the OpenAI API.
MODEL_NAME = "tiny"
#: Seconds from SIGTERM to SIGKILL of what is left of a server's tree.
GRACE_S = 30.0
alive = supervisor.alive
descendants = supervisor.descendants
#: Variables that would change what the engine does if inherited from the caller: a
#: kvshare pool's settings, vLLM's legacy KV size (it wins over ``--kv-cache-memory-bytes``).
_NOT_INHERITED_PREFIXES = ("KVSHARE_",)
_NOT_INHERITED = frozenset({"VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH", "VLLM_CPU_OMP_THREADS_BIND"})


class ServerError(RuntimeError):
    """A server did not start or stop as asked; the message carries its log's last lines."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def kvshare_runtime_path() -> list[Path]:
    """``PYTHONPATH`` entries that activate kvshare in an engine from this source tree: the
    engine hooks' boot folder (its ``sitecustomize``) and the source folder itself."""
    src = checkout_root() / "src"
    return [src / "kvshare" / "runtime" / "engines" / "boot", src]


@dataclass(frozen=True)
class ServerOptions:
    """How one server is started. Defaults: the tiny model, quickest start-up on CPU."""

    kvshare: bool
    """Whether kvshare's hooks are active in the engine."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment: the pool's ``KVSHARE_*`` settings, or anything vLLM reads."""
    kv_cache_bytes: int | None = None
    """KV cache size given to plain vLLM (``--kv-cache-memory-bytes``). With kvshare the
    pool decides and this must be ``None``."""
    environment: ServingEnvironment = DEFAULT_SERVING
    model: Path | None = None
    """Model folder (default: the generated tiny model)."""
    port: int = 0
    """0: a free port."""
    block_size: int = 32
    """Tokens per KV block (vLLM's CPU build needs a multiple of 32)."""
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    """The tiny model's own dtype (see :mod:`.tiny_model` for why not bf16)."""
    enforce_eager: bool = True
    cpu_bind: str = "0"
    """``VLLM_CPU_OMP_THREADS_BIND``: the cores of the worker's threads. Servers running
    together are pinned apart (with ``auto`` every server binds core 0)."""
    cache_root: Path | None = None
    """``VLLM_CACHE_ROOT``, shared by the servers of one run (warm caches start faster)."""
    runtime: Sequence[Path] | None = None
    """``PYTHONPATH`` that activates kvshare (default :func:`kvshare_runtime_path`)."""
    extra_args: Sequence[str] = ()
    niceness: int = 0
    """CPU niceness of vLLM's processes once the server answers (0: this process's own;
    its start-up keeps this process's, so that it is not starved by whatever else runs).
    Tests that measure the node agent under load raise it: on a node the agent runs on
    CPU of its own (its DaemonSet's request), while on a two-core test machine two
    decoding servers would otherwise starve it, and the test would measure the machine
    rather than the agent."""

    def argv(self, port: int) -> list[str]:
        """The ``vllm serve`` command line."""
        model = self.model or tiny_model_dir()
        argv = [
            str(self.environment.path() / "bin" / "vllm"),
            "serve",
            str(model),
            *("--served-model-name", MODEL_NAME),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--block-size", str(self.block_size)),
            *("--max-model-len", str(self.max_model_len)),
            *("--max-num-seqs", str(self.max_num_seqs)),
            *("--max-num-batched-tokens", str(self.max_num_batched_tokens)),
            *("--dtype", self.dtype, "--seed", "0"),
            *("--uvicorn-log-level", "warning"),
        ]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.kv_cache_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return [*argv, *self.extra_args]

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment: ``base`` without pool or KV-size settings, plus these."""
        environ = {
            key: value
            for key, value in base.items()
            if key not in _NOT_INHERITED and not key.startswith(_NOT_INHERITED_PREFIXES)
        }
        environ.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # POST /reset_prefix_cache (the tests empty the prefix cache between rounds).
                "VLLM_SERVER_DEV_MODE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.cache_root is not None:
            environ["VLLM_CACHE_ROOT"] = str(self.cache_root)
        if self.kvshare:
            runtime = self.runtime if self.runtime is not None else kvshare_runtime_path()
            environ["PYTHONPATH"] = os.pathsep.join(str(path) for path in runtime)
            environ["KVSHARE_ENABLE"] = "1"
            environ.setdefault("KVSHARE_BACKEND", "host")
        environ.update(self.env)
        return environ


class VllmServer:
    """One ``vllm serve`` process tree. Use as a context manager, or call :meth:`start`
    and :meth:`stop`; :meth:`stop` is idempotent and always leaves no process behind."""

    def __init__(self, name: str, options: ServerOptions, log_path: Path) -> None:
        if options.kvshare and options.kv_cache_bytes is not None:
            raise ValueError("with kvshare the pool sizes the KV cache: pass no kv_cache_bytes")
        self.name = name
        self.options = options
        self.log_path = log_path
        self.port = options.port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None
        """Seconds from :meth:`start` until the API answered."""
        self._tree: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ServerError(f"{self.name} was never started")
        return self.process.pid

    def start(self) -> VllmServer:
        """Start the process (returns at once; :meth:`wait_ready` waits for the API)."""
        if self.process is not None:
            raise ServerError(f"{self.name} was already started (pid {self.process.pid})")
        self.options.environment.require()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:
            # The supervisor (a script of the standard library only) ends the whole tree
            # whatever happens to vLLM's processes or to this one; its own process group
            # lets kill() reach every process at once. It stays in this process's session:
            # where the kernel groups processes by session (autogroup), servers in sessions
            # of their own did not share the cores. vLLM's processes wait for each other
            # by spinning on sched_yield, and with two busy servers in two sessions one ran
            # at its speed alone while the other got 0-4 % of it (`python bench/run.py
            # cpu-sharing`); in one group they share the cores evenly.
            command = [sys.executable, supervisor.__file__, "--grace", str(GRACE_S), "--"]
            self.process = subprocess.Popen(
                [*command, *self.options.argv(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.options.environ(os.environ),
                process_group=0,
            )
        self.started_at = time.monotonic()
        log.info("started %s (pid %d) on %s", self.name, self.process.pid, self.url)
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 240.0) -> VllmServer:
        """Wait until the OpenAI API answers; :class:`ServerError` if the server exits first
        or takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            self._remember_tree()
            code = self.process.poll() if self.process is not None else None
            if code is not None:
                raise ServerError(
                    f"{self.name} exited with status {code} during start-up; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.name} did not answer within {timeout_s:.0f} s; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)
        self._remember_tree()
        if self.options.niceness and self.process is not None:
            supervisor.lower_priority(self.process.pid, self.options.niceness)
        self.ready_after_s = time.monotonic() - self.started_at
        log.info("%s ready after %.1f s", self.name, self.ready_after_s)
        return self

    def tree(self) -> list[int]:
        """The server's live processes: its main process and everything below it."""
        if self.process is None or not alive(self.process.pid):
            return []
        return [self.process.pid, *descendants(self.process.pid)]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the server's live processes by role: ``api`` (the
        ``vllm serve`` process, which speaks HTTP), ``engine_core`` (vLLM's engine-core
        process, which schedules every step) and ``worker`` (the processes below it, which
        compute the steps). Processes that have exited are no longer counted."""
        if self.process is None:
            return {}
        # Below the supervisor: vllm serve, then its engine core, then the workers.
        depths = supervisor.cpu_by_depth(self.process.pid)
        return {
            "api": depths.get(1, 0.0),
            "engine_core": depths.get(2, 0.0),
            "worker": sum(cpu_s for depth, cpu_s in depths.items() if depth >= 3),
        }

    def _remember_tree(self) -> None:
        """Note every process of the tree seen so far: a worker reparented away from a dead
        parent is still found (and ended) by :meth:`stop`."""
        self._tree.update(self.tree())

    def _leftovers(self) -> list[int]:
        return [pid for pid in self._tree if alive(pid)]

    def kill(self) -> None:
        """SIGKILL every process of the tree at once (a crash, an OOM kill)."""
        self._remember_tree()
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, signum: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)
        for pid in self._leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def terminate(self) -> None:
        """SIGTERM the API server, as Kubernetes stops a pod (vLLM ends its engine itself)."""
        self._remember_tree()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_exited(self, timeout_s: float) -> bool:
        """Wait until every process of the tree has exited; whether they did in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None:
                self.process.poll()
            if not self._leftovers() and (self.process is None or self.process.poll() is not None):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL what is left; the exit status of
        the main process (``None`` if it was never started)."""
        if self.process is None:
            return None
        self.terminate()
        if not self.wait_exited(timeout_s):
            log.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
            self._signal_all(signal.SIGKILL)
            self.wait_exited(10.0)
        return self.process.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def running(servers: Sequence[VllmServer], timeout_s: float = 240.0) -> Iterator[None]:
    """Start every server at once, wait until all answer, stop them all on the way out."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s)
        yield
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
