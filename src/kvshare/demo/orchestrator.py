"""Runs the demo: the node agent and one process per simulated model server, twice over.

The same trace runs at the same time in two worlds of the same size:

- **static partitions** — each model's pool has a fixed lease of an equal share of the
  GPU (what ``--gpu-memory-utilization`` gives a model today);
- **elastic (kvshare)** — each model's pool is leased by the node agent's broker, which
  lends the GPU's memory to whoever needs it and reclaims it under contention.

The orchestrator starts ``kvshare node --fake-gpus 1x<GPU>`` as a child (the broker, and
the Prometheus endpoint on :9400 or a free port), then ``2 x models`` server processes
(:mod:`kvshare.demo.server`), waits until every pool is up, gives them one common start
instant, and collects their samples while the live view shows them. Throughout, it scrapes
the node agent's metrics and checks the broker's books: what it charges the pools on the
GPU never sums to more than the GPU's memory (its headroom is 0 here, so static partitions
and elastic pools share the same total). At the end it checks every server's counts
against the trace, writes ``results.json`` and the PNG into the output folder, and prints
the comparison.

It imports neither the runtime nor the node agent: it talks to both through their real
interfaces (processes, pipes, the broker's socket path, the metrics endpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from kvshare.api import names
from kvshare.api.quantity import format_bytes
from kvshare.demo import trace as trace_mod
from kvshare.demo.bound import Bound, sharing_bound
from kvshare.demo.stats import (
    BookViolation,
    Comparison,
    Mode,
    Sample,
    ServerResult,
    check_consistency,
    check_pool_books,
    compare,
    sample_from_message,
)
from kvshare.demo.view import LiveView

__all__ = ["DemoError", "DemoOptions", "DemoOutcome", "NodeAgent", "pick_metrics_port", "run_demo"]

log = logging.getLogger(__name__)

GIB = 2**30
#: Seconds allowed for the node agent and every server to come up.
STARTUP_TIMEOUT_S = 90.0
#: Seconds allowed past the trace's end for the servers to report.
FINISH_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1
#: The trace runs this many times as fast as the wall clock, so that bursts of production
#: length fit a one-minute demo: the default 144 s trace takes 36 s. The engines keep the
#: trace's time; kvshare (broker round trips, reclaim deadlines, the pools' reserve and
#: report threads) keeps wall time, so every delay of its counts four times over in the
#: trace's time: the speed-up handicaps elastic sharing, it never helps it.
DEFAULT_SPEED = 4.0


class DemoError(RuntimeError):
    """The demo could not run; the message says what failed and where its log is."""


@dataclass(frozen=True)
class World:
    """One of the runs side by side: static partitions, or elastic under a broker policy."""

    name: str
    mode: Mode
    policy: str | None = None


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvshare demo`` (and the ``elastic`` benchmark) run."""

    duration_s: float = trace_mod.TraceConfig.duration_s
    models: int = trace_mod.TraceConfig.models
    gpu_memory_bytes: int = trace_mod.TraceConfig.gpu_memory_bytes
    patience_s: float = trace_mod.TraceConfig.patience_s
    cycles: int = trace_mod.TraceConfig.cycles
    seed: int = 0
    trace_file: Path | None = None
    output: Path = Path("out/demo")
    metrics_port: int = names.METRICS_PORT
    live: bool = True
    plot: bool = True
    #: Trace seconds between two samples of a server.
    sample_s: float = 0.5
    #: Trace seconds per wall-clock second (see :data:`DEFAULT_SPEED`).
    speed: float = DEFAULT_SPEED
    #: One elastic world per broker policy, each with its own node agent (None: the node
    #: agent's default policy). The first is the one the live view and the plot show.
    policies: tuple[str | None, ...] = (None,)
    #: Every elastic pool's kvCache.min, as a fraction of an equal share of the GPU.
    kv_min_share: float = 0.0

    def worlds(self) -> list[World]:
        """The static world, then the elastic ones."""
        elastic = [
            World("elastic" if i == 0 else f"elastic-{policy}", "elastic", policy)
            for i, policy in enumerate(self.policies)
        ]
        return [World("static", "static"), *elastic]

    def trace(self) -> trace_mod.Trace:
        """The trace to run: loaded from ``trace_file`` or generated from the options."""
        if self.trace_file is not None:
            return trace_mod.load(self.trace_file)
        config = trace_mod.TraceConfig(
            seed=self.seed,
            duration_s=self.duration_s,
            models=self.models,
            gpu_memory_bytes=self.gpu_memory_bytes,
            patience_s=self.patience_s,
            cycles=self.cycles,
        )
        return trace_mod.generate(config)


@dataclass
class DemoOutcome:
    """Everything a run produced."""

    trace: trace_mod.Trace
    results: list[ServerResult]
    comparison: Comparison
    pool_violations: list[BookViolation]
    broker_violations: list[BookViolation]
    problems: list[str]
    metrics_url: str
    broker_checks: int
    overdue_reclaims: int = 0
    """Reclaims that missed the broker's deadline (read from its metrics)."""
    bound: Bound | None = None
    """What the trace allows: served from partitions and from instant sharing, simulated."""
    plot: Path | None = None
    summary: Path | None = None
    wall_s: float = 0.0
    #: Trace seconds per wall-clock second the run used.
    speed: float = 1.0
    elastic_kv_series: list[tuple[float, int]] = field(default_factory=list)
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    """Every elastic world against the static one, by world name (``comparison`` is the
    first's)."""
    policies: dict[str, str | None] = field(default_factory=dict)
    """The broker policy of each elastic world (None: the node agent's default)."""
    by_world: dict[str, list[ServerResult]] = field(default_factory=dict)
    """Every world's results (``results`` holds the static world's and the first elastic
    world's)."""

    def results_of(self, world: str) -> list[ServerResult]:
        """The results of one world (``static``, or an elastic world's name)."""
        return self.by_world.get(world, [])

    @property
    def ok(self) -> bool:
        """No over-commitment and counts consistent with the trace."""
        return not (self.pool_violations or self.broker_violations or self.problems)


# --- child processes ------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the orchestrator dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[str]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
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


def _stop_all(children: Sequence[_Child], timeout_s: float = 30.0) -> None:
    """Stop every child, all at once (each is asked, then each is waited for)."""
    for child in children:
        child.request_stop()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.wait_stopped(deadline)


def _spawn(
    name: str, argv: list[str], log_path: Path, env: dict[str, str], *, pipes: bool
) -> _Child:
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
    return _Child(name, process, log_path)


def _read_lines(key: tuple[Mode, int], stream: IO[str], out: queue.Queue[Any]) -> None:
    """Reader thread: one per server; puts ``(key, message)`` and ``(key, None)`` at EOF."""
    for line in stream:
        try:
            out.put((key, json.loads(line)))
        except json.JSONDecodeError:
            out.put((key, {"kind": "error", "message": f"unreadable line {line[:200]!r}"}))
    out.put((key, None))


# --- the node agent -------------------------------------------------------------------


def pick_metrics_port(preferred: int) -> tuple[int, bool]:
    """``preferred`` if it is free on this host, else a free port; and whether it moved.

    ``preferred`` 0 asks for any free port (not a move).
    """
    for port in dict.fromkeys((preferred, 0)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            chosen: int = probe.getsockname()[1]
            return chosen, preferred not in (0, chosen)
    raise DemoError("no free TCP port for the metrics endpoint")


@dataclass
class NodeAgent:
    """``kvshare node`` with one fake GPU, its broker socket and its metrics endpoint."""

    child: _Child
    broker_socket: Path
    metrics_url: str

    @classmethod
    def start(
        cls,
        run_dir: Path,
        gpu_bytes: int,
        metrics_port: int,
        env: dict[str, str],
        policy: str | None = None,
    ) -> NodeAgent:
        run_dir.mkdir(exist_ok=True)
        broker = run_dir / names.BROKER_SOCKET_NAME
        argv = [
            sys.executable,
            "-m",
            "kvshare.cli",
            "node",
            "--fake-gpus",
            f"1x{format_bytes(gpu_bytes)}",
            # The whole fake GPU is KV memory: the same total as the static partitions.
            "--headroom",
            "0",
            "--node-name",
            "kvshare-demo",
            "--broker-socket",
            str(broker),
            "--metrics-address",
            f":{metrics_port}",
            # No cluster here: no Kubernetes API, and a kubelet directory nobody serves.
            "--no-kube",
            "--device-plugin-dir",
            str(run_dir / "device-plugins"),
            *(("--broker-policy", policy) if policy else ()),
        ]
        (run_dir / "device-plugins").mkdir(exist_ok=True)
        name = "node agent" + (f" ({policy})" if policy else "")
        child = _spawn(name, argv, run_dir / "node.log", env, pipes=False)
        return cls(child, broker, f"http://127.0.0.1:{metrics_port}/metrics")

    def gpu_uuid(self) -> str:
        """The UUID of the agent's (single) fake GPU, as its metrics label it."""
        text = scrape(self.metrics_url)
        books = broker_books(text) if text is not None else []
        if not books:
            raise DemoError(f"the node agent's metrics name no GPU:\n{self.child.log_tail()}")
        return books[0].gpu

    def pool_env(self, pod: str, *, kv_max: int, kv_min: int = 0) -> dict[str, str]:
        """The ``KVSHARE_*`` environment of a pool leased by this agent's broker (what the
        operator and the device plugin give a model-server pod)."""
        return {
            "KVSHARE_BROKER_SOCKET": str(self.broker_socket),
            "KVSHARE_GPU_UUIDS": self.gpu_uuid(),
            "KVSHARE_POD_NAMESPACE": "kvshare-demo",
            "KVSHARE_POD_NAME": pod,
            "KVSHARE_POD_UID": str(uuid.uuid4()),
            "KVSHARE_MODELSERVER": pod,
            "KVSHARE_KV_MIN": str(kv_min),
            "KVSHARE_KV_MAX": str(kv_max),
            "KVSHARE_KV_PRIORITY": "100",
            "KVSHARE_STATIC_BYTES": "0",
        }

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.child.process.poll() is not None:
                raise DemoError(
                    f"the node agent exited with status {self.child.process.returncode}:\n"
                    f"{self.child.log_tail()}"
                )
            text = scrape(self.metrics_url) if self.broker_socket.exists() else None
            if text is not None and broker_books(text):
                return
            time.sleep(0.1)
        raise DemoError(f"the node agent did not come up in time:\n{self.child.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then wait (and terminate or kill when it does not stop)."""
        _stop_all([self.child], timeout_s=10.0)


def scrape(url: str, timeout_s: float = 2.0) -> str | None:
    """The metrics text at ``url``, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body.decode("utf-8")
    except (urllib.error.URLError, OSError):
        return None


@dataclass(frozen=True)
class GpuBooks:
    """One GPU in the broker's books, from one scrape of its metrics."""

    gpu: str
    charged: int
    """Sum over the GPU's pools of what the broker counts as taken for each (at least the
    lease, and the old lease until a reclaim is acknowledged)."""
    budget: int
    """What the broker may lend: total - headroom - static footprints."""
    overdue: int = 0
    """Reclaims on the GPU so far that missed the broker's deadline."""


def broker_books(text: str) -> list[GpuBooks]:
    """Every GPU of the node agent's metrics text, with its pools' charges summed."""
    from prometheus_client.parser import text_string_to_metric_families

    charged: dict[str, float] = {}
    overdue: dict[str, float] = {}
    gpu_values: dict[str, dict[str, float]] = {}
    wanted = {
        "kvshare_gpu_memory_total_bytes": "total",
        "kvshare_gpu_memory_headroom_bytes": "headroom",
        "kvshare_gpu_memory_static_bytes": "static",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gpu = sample.labels.get("gpu", "")
            if sample.name == "kvshare_pool_kv_charged_bytes":
                charged[gpu] = charged.get(gpu, 0.0) + sample.value
            elif sample.name == "kvshare_broker_reclaim_deadline_missed_total":
                overdue[gpu] = overdue.get(gpu, 0.0) + sample.value
            elif sample.name in wanted:
                gpu_values.setdefault(gpu, {})[wanted[sample.name]] = sample.value
    return [
        GpuBooks(
            gpu,
            int(charged.get(gpu, 0)),
            int(v.get("total", 0) - v.get("headroom", 0) - v.get("static", 0)),
            int(overdue.get(gpu, 0)),
        )
        for gpu, v in gpu_values.items()
    ]


# --- the run --------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)  # the children inherit the caller's settings (log level, paths)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def _children() -> Iterator[list[_Child]]:
    """The children started inside; on the way out the servers are stopped first (they
    leave the broker cleanly), then the node agent (started first)."""
    started: list[_Child] = []
    try:
        yield started
    finally:
        _stop_all(started[1:])
        _stop_all(started[:1])


def run_demo(options: DemoOptions, stream: TextIO = sys.stdout) -> DemoOutcome:
    """Run both worlds on one trace and return what happened (see the module doc).

    The results, the plot (``options.plot``) and the report are written before the
    children are stopped, so the servers' pools unmap while the plot is drawn.
    """
    began = time.monotonic()
    trace = options.trace()
    config = trace.config
    options.output.mkdir(parents=True, exist_ok=True)
    trace_path = options.output / "trace.json"
    trace_mod.save(trace, trace_path)
    port, moved = pick_metrics_port(options.metrics_port)
    if moved:
        stream.write(f"port {options.metrics_port} is taken: metrics are served on :{port}\n")
    worlds = options.worlds()
    elastic = [w for w in worlds if w.mode == "elastic"]
    agents = "the node agent" if len(elastic) == 1 else f"{len(elastic)} node agents"
    stream.write(
        f"Starting {agents} (one fake {format_bytes(config.gpu_memory_bytes)} GPU each) and "
        f"{len(worlds) * config.models} model servers ({config.models} per run: "
        f"{', '.join(w.name for w in worlds)})...\n"
    )
    stream.flush()
    messages: queue.Queue[Any] = queue.Queue()
    # Unix socket paths must stay short (< 108 bytes): sockets live in a short temp dir.
    with (
        tempfile.TemporaryDirectory(prefix="kvs-demo-", dir="/tmp") as run_dir,
        _children() as started,
    ):
        base_env = _child_env()
        nodes: dict[str, NodeAgent] = {}
        for index, world in enumerate(elastic):
            # The first agent serves metrics on the chosen port, the others on free ones.
            metrics = port if index == 0 else pick_metrics_port(0)[0]
            place = Path(run_dir) / f"n{index}"
            node = NodeAgent.start(place, config.gpu_memory_bytes, metrics, base_env, world.policy)
            nodes[world.name] = node
            started.append(node.child)
        share = config.gpu_memory_bytes // config.models
        launch = _Launcher(options, trace_path, share, base_env, messages, started)
        # Static servers need no broker: they import and set up while the agents start.
        servers: dict[tuple[str, int], _Child] = {
            ("static", m): launch.server(worlds[0], m) for m in range(config.models)
        }
        kv_min = int(share * options.kv_min_share)
        for world in elastic:
            node = nodes[world.name]
            node.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
            for model in range(config.models):
                # No cap below the GPU, and a guaranteed minimum of kv_min_share of a share
                # (0 by default): what a model holds beyond is the broker's to decide.
                env = node.pool_env(f"model-{model}", kv_max=config.gpu_memory_bytes, kv_min=kv_min)
                servers[(world.name, model)] = launch.server(world, model, env)
        view = LiveView(
            stream,
            duration_s=config.duration_s,
            gpu_bytes=config.gpu_memory_bytes,
            models=config.models,
            interactive=None if options.live else False,
        )
        run = _Run(options, trace, nodes, servers, messages, view)
        run.wait_ready()
        stream.write(f"All pools up after {time.monotonic() - began:.1f} s; running.\n")
        run.collect(run.start())
        outcome = run.outcome()
        outcome.bound = sharing_bound(trace)
        outcome.speed = options.speed
        outcome.summary = options.output / "results.json"
        if options.plot:
            outcome.plot = _plot(outcome, options.output / "kvshare-demo.png")
        outcome.wall_s = time.monotonic() - began
        _write_results(outcome, outcome.summary)
        stream.write("\n".join(report_lines(outcome, options)) + "\n")
        stream.flush()
    return outcome


@dataclass
class _Launcher:
    """Starts model-server processes and their reader threads."""

    options: DemoOptions
    trace_path: Path
    static_share: int
    base_env: dict[str, str]
    messages: queue.Queue[Any]
    started: list[_Child]

    def server(self, world: World, model: int, env: dict[str, str] | None = None) -> _Child:
        argv = [
            *(sys.executable, "-m", "kvshare.demo.server", "--trace", str(self.trace_path)),
            *("--model", str(model), "--mode", world.mode, "--world", world.name),
            *("--sample-s", str(self.options.sample_s), "--speed", str(self.options.speed)),
        ]
        if world.mode == "static":
            argv += ["--share-bytes", str(self.static_share)]
        log_path = self.options.output / f"server-{world.name}-{model}.log"
        child = _spawn(
            f"{world.name} model-{model}",
            argv,
            log_path,
            {**self.base_env, **(env or {})},
            pipes=True,
        )
        self.started.append(child)
        assert child.process.stdout is not None
        threading.Thread(
            target=_read_lines,
            args=((world.name, model), child.process.stdout, self.messages),
            daemon=True,
        ).start()
        return child


def _plot(outcome: DemoOutcome, path: Path) -> Path:
    from kvshare.demo.plot import write_plot

    config = outcome.trace.config
    return write_plot(
        path,
        outcome.results,
        outcome.comparison,
        trace_mod.busy_windows(outcome.trace),
        gpu_bytes=config.gpu_memory_bytes,
        duration_s=config.duration_s,
    )


@dataclass
class _Run:
    """The live part of one run: the servers' messages, the view, the broker's books.

    Owned by the orchestrator's main thread; reader threads only put into ``messages``.
    """

    options: DemoOptions
    trace: trace_mod.Trace
    nodes: dict[str, NodeAgent]
    """The node agent of each elastic world, by world name."""
    servers: dict[tuple[str, int], _Child]
    messages: queue.Queue[Any]
    view: LiveView
    samples: dict[tuple[str, int], list[Sample]] = field(default_factory=dict)
    latest: dict[tuple[str, int], Sample] = field(default_factory=dict)
    results: dict[tuple[str, int], ServerResult] = field(default_factory=dict)
    broker_violations: list[BookViolation] = field(default_factory=list)
    kv_series: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    checks: int = 0
    overdue_reclaims: int = 0

    def fail(self, key: tuple[str, int], why: str) -> DemoError:
        child = self.servers[key]
        return DemoError(
            f"{child.name} failed: {why}\nlast lines of {child.log_path}:\n{child.log_tail()}"
        )

    def wait_ready(self) -> None:
        """Block until every server's pool is up."""
        ready: set[tuple[str, int]] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self.servers):
            try:
                key, message = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = ", ".join(self.servers[k].name for k in self.servers if k not in ready)
                raise DemoError(f"timed out waiting for {late} to start") from None
            if message is None or message.get("kind") == "error":
                raise self.fail(key, (message or {}).get("message", "exited during start-up"))
            if message.get("kind") == "ready":
                ready.add(key)

    def start(self) -> float:
        """Give every server the same start instant; returns it."""
        start = time.monotonic() + 0.2
        for child in self.servers.values():
            assert child.process.stdin is not None
            child.process.stdin.write(json.dumps({"start": start}) + "\n")
            child.process.stdin.flush()
        self.samples = {key: [] for key in self.servers}
        return start

    def check_broker(self, start: float) -> None:
        """One snapshot of every broker's books from its metrics."""
        t = round((time.monotonic() - start) * self.options.speed, 3)
        for world, node in self.nodes.items():
            text = scrape(node.metrics_url)
            if text is None:
                continue
            self.checks += 1
            for books in broker_books(text):
                self.kv_series.setdefault(world, []).append((t, books.charged))
                self.overdue_reclaims = max(self.overdue_reclaims, books.overdue)
                if books.charged > books.budget:
                    self.broker_violations.append(
                        BookViolation(
                            t,
                            f"{world}: GPU {books.gpu}: pools charged {books.charged} bytes, "
                            f"over the budget of {books.budget}",
                        )
                    )

    def handle(self, key: tuple[str, int], message: dict[str, Any] | None) -> None:
        if message is None:
            if key not in self.results:
                raise self.fail(key, "exited before reporting its result")
            return
        kind = message.get("kind")
        if kind == "sample":
            sample = sample_from_message(message)
            self.samples[key].append(sample)
            self.latest[key] = sample
        elif kind == "result":
            self.results[key] = ServerResult.from_message(message, self.samples[key])
        elif kind == "error":
            raise self.fail(key, message.get("message", "unknown error"))

    def collect(self, start: float) -> None:
        """Until every server has reported: messages, broker checks, the live view."""
        config = self.trace.config
        footer = [f"metrics: {self.first.metrics_url}   output: {self.options.output}/"]
        next_scrape = next_view = 0.0
        deadline = start + config.duration_s / self.options.speed + FINISH_GRACE_S
        while len(self.results) < len(self.servers):
            now = time.monotonic()
            if now >= next_scrape:
                self.check_broker(start)
                next_scrape = now + 0.5
            if now >= next_view:
                elapsed = max(0.0, now - start) * self.options.speed
                self.view.update(elapsed, self._shown(), footer)
                next_view = now + 0.25
            try:
                key, message = self.messages.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    late = [self.servers[k].name for k in self.servers if k not in self.results]
                    raise DemoError(f"no result from {', '.join(late)} in time") from None
                continue
            self.handle(key, message)
        self.view.update(config.duration_s, self._shown(), footer)

    @property
    def first(self) -> NodeAgent:
        """The node agent of the first elastic world (the one the view shows)."""
        return next(iter(self.nodes.values()))

    def _shown(self) -> dict[tuple[Mode, int], Sample]:
        """The latest samples of the static world and the first elastic one."""
        first = next(iter(self.nodes))
        shown: dict[tuple[Mode, int], Sample] = {}
        for (world, model), sample in self.latest.items():
            if world == "static":
                shown[("static", model)] = sample
            elif world == first:
                shown[("elastic", model)] = sample
        return shown

    def outcome(self) -> DemoOutcome:
        static = [self.results[k] for k in sorted(self.results) if k[0] == "static"]
        comparisons: dict[str, Comparison] = {}
        mine: dict[str, list[ServerResult]] = {}
        for world in self.nodes:
            mine[world] = [self.results[k] for k in sorted(self.results) if k[0] == world]
            comparisons[world] = compare(static + mine[world], self.kv_series.get(world, []))
        first = next(iter(self.nodes))
        everything = static + [r for world in self.nodes for r in mine[world]]
        return DemoOutcome(
            trace=self.trace,
            results=static + mine[first],
            comparison=comparisons[first],
            pool_violations=check_pool_books(everything),
            broker_violations=self.broker_violations,
            problems=[p for r in everything for p in check_consistency(r)],
            metrics_url=self.first.metrics_url,
            broker_checks=self.checks,
            overdue_reclaims=self.overdue_reclaims,
            elastic_kv_series=self.kv_series.get(first, []),
            comparisons=comparisons,
            policies={w.name: w.policy for w in self.options.worlds() if w.mode == "elastic"},
            by_world={"static": static, **mine},
        )


def _write_results(outcome: DemoOutcome, path: Path) -> None:
    payload = {
        "trace": asdict(outcome.trace.config),
        "ratio": outcome.comparison.ratio,
        "per_model": [asdict(s) for s in outcome.comparison.per_model],
        "static": asdict(outcome.comparison.static),
        "elastic": asdict(outcome.comparison.elastic),
        "pool_violations": [asdict(v) for v in outcome.pool_violations],
        "broker_violations": [asdict(v) for v in outcome.broker_violations],
        "broker_checks": outcome.broker_checks,
        "overdue_reclaims": outcome.overdue_reclaims,
        "bound": asdict(outcome.bound) if outcome.bound is not None else None,
        "problems": outcome.problems,
        "wall_s": outcome.wall_s,
        "speed": outcome.speed,
        "elastic_kv_series": outcome.elastic_kv_series,
        "worlds": {
            name: {
                "policy": outcome.policies.get(name),
                "ratio": comparison.ratio,
                "static": asdict(comparison.static),
                "elastic": asdict(comparison.elastic),
                "per_model": [asdict(s) for s in comparison.per_model],
            }
            for name, comparison in outcome.comparisons.items()
        },
        "servers": [asdict(r) for r in outcome.results],
    }
    path.write_text(json.dumps(payload) + "\n", encoding="utf-8")


def summary_table(comparison: Comparison) -> list[str]:
    """The end-of-run table, per model and in total, both modes."""
    header = (
        f"{'run':<8} {'model':<8} {'served':>7} {'gave up':>7} {'offered':>7} {'p50 wait':>9} "
        f"{'p95 wait':>9} {'peak KV':>9} {'mean KV':>9} {'mean used':>9} {'preempt':>7} "
        f"{'reclaims':>8}"
    )
    lines = [header, "-" * len(header)]
    rows: Sequence[Any] = [
        *[s for s in comparison.per_model if s.mode == "static"],
        comparison.static,
        *[s for s in comparison.per_model if s.mode == "elastic"],
        comparison.elastic,
    ]
    for row in rows:
        model = "total" if row.model is None else f"model-{row.model}"
        lines.append(
            f"{row.mode:<8} {model:<8} {row.served:>7} {row.abandoned:>7} {row.offered:>7} "
            f"{row.p50_wait_s:>8.2f}s {row.p95_wait_s:>8.2f}s "
            f"{row.peak_kv / GIB:>5.2f} GiB {row.mean_kv / GIB:>5.2f} GiB "
            f"{row.mean_used / GIB:>5.2f} GiB "
            f"{row.preemptions:>7} {row.reclaims:>8}"
        )
        if row.model is None:
            lines.append("")
    return lines


def _bound_lines(outcome: DemoOutcome) -> list[str]:
    bound = outcome.bound
    if bound is None:
        return []
    return [
        f"What this trace allows (the same schedulers simulated without memory): "
        f"{sum(bound.partitioned)} served from partitions, {sum(bound.shared)} if every "
        f"freed block went to any model at once: x{bound.ratio:.2f}.",
    ]


def _other_world_lines(outcome: DemoOutcome) -> list[str]:
    """One line per elastic world beyond the first (the table shows the first)."""
    lines = []
    for name, comparison in list(outcome.comparisons.items())[1:]:
        policy = outcome.policies.get(name) or "the default"
        lines.append(
            f"Elastic under broker policy {policy}: served {comparison.elastic.served}, "
            f"x{comparison.ratio:.2f}; gave up {comparison.elastic.abandoned}; p95 queueing "
            f"delay {comparison.elastic.p95_wait_s:.2f} s."
        )
    return lines


def report_lines(outcome: DemoOutcome, options: DemoOptions) -> list[str]:
    """What the demo prints at the end: the table, the verdict, the checks, the files."""
    config = outcome.trace.config
    comparison = outcome.comparison
    violations = [*outcome.broker_violations, *outcome.pool_violations]
    lines = [
        "",
        f"Same trace ({len(outcome.trace.requests)} requests, {config.models} models, "
        f"{config.duration_s:g} s), same {config.gpu_memory_bytes / GIB:g} GiB GPU:",
        "",
        *summary_table(comparison),
        f"Elastic served {comparison.elastic.served} requests, static {comparison.static.served}"
        f": x{comparison.ratio:.2f}. Clients that gave up after {config.patience_s:g} s "
        f"without a first token: {comparison.static.abandoned} -> "
        f"{comparison.elastic.abandoned}. p95 queueing delay "
        f"{comparison.static.p95_wait_s:.2f} s -> {comparison.elastic.p95_wait_s:.2f} s.",
        *_bound_lines(outcome),
        *_other_world_lines(outcome),
        f"Memory books: {outcome.broker_checks} snapshots of the broker's books and every "
        f"pool sample checked: {len(violations)} over-commitments. Reclaims past the "
        f"broker's deadline: {outcome.overdue_reclaims}.",
    ]
    if outcome.plot is not None:
        lines.append(f"Plot:    {outcome.plot}")
    lines += [
        f"Results: {outcome.summary} (the trace is {options.output / 'trace.json'}; "
        "--trace runs it again)",
        f"Metrics were served at {outcome.metrics_url}. Wall time {outcome.wall_s:.0f} s.",
    ]
    lines += [f"PROBLEM: {problem}" for problem in outcome.problems]
    lines += [f"OVER-COMMITTED at {v.t:.2f} s: {v.what}" for v in violations[:10]]
    return lines
