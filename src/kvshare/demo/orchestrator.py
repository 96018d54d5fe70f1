"""Runs the demo: node agents and one process per model server, in static and elastic worlds.

The same trace runs in worlds of the same size:

- **static partitions** — each model's pool has a fixed lease of an equal share of the
  GPU (what ``--gpu-memory-utilization`` gives a model today);
- **elastic (kvshare)** — each model's pool is leased by a node agent's broker, which
  lends the GPU's memory to whoever needs it and reclaims it under contention (one such
  world per broker policy asked for, each with its own agent).

The orchestrator starts ``kvshare node --fake-gpus 1x<GPU>`` per elastic world
(:mod:`kvshare.demo.node_agent`: the broker, and the Prometheus endpoint on :9400 or a free
port), then ``models`` server processes per world, waits until every pool is up, gives
them one common start instant, and collects their samples while the live view shows them.
Throughout, it scrapes the agents' metrics and checks the brokers' books: what a broker
charges the pools on the GPU never sums to more than the GPU's memory (its headroom keeps
the lendable part at exactly the GPU of the static world). At the end it checks every
server's counts against the trace, writes ``results.json`` and the PNG into the output
folder, and prints the comparison (:mod:`kvshare.demo.summary`).

The model servers are simulated engines (:mod:`kvshare.demo.server`), every world at once
and faster than the wall clock (``speed``); or, with ``engine="vllm"``, each is a real
``vllm serve`` (vLLM's CPU build and the tiny model, ``make engines``;
:mod:`kvshare.demo.real_server`) driven by its model's requests over HTTP: plain vLLM with
a KV cache of an equal share in the static world, vLLM with kvshare leased by the broker
in an elastic one. Real servers run one world after the other (two worlds of vLLM servers
at once would not fit this machine's memory), in real time.

It imports neither the runtime nor the node agent: it talks to both through their real
interfaces (processes, pipes, the broker's socket path, the metrics endpoint).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvshare.api.quantity import format_bytes
from kvshare.demo import trace as trace_mod
from kvshare.demo.bound import sharing_bound
from kvshare.demo.children import Child, Children, DemoError, child_env, read_lines, spawn, stop_all
from kvshare.demo.node_agent import NodeAgent, broker_books, pick_metrics_port, scrape
from kvshare.demo.options import (
    ENGINES,
    STARTUP_TIMEOUT_S,
    DemoOptions,
    DemoOutcome,
    Engine,
    World,
)
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

if TYPE_CHECKING:
    from kvshare.demo.capacity import CapacityReport

__all__ = [
    "ENGINES",
    "DemoError",
    "DemoOptions",
    "DemoOutcome",
    "Engine",
    "World",
    "run_demo",
]

GIB = 2**30
#: Seconds allowed past the trace's end for the servers to report.
FINISH_GRACE_S = 30.0

#: Pool settings of a real vLLM server on a demo GPU of tens of MiB: 256 KiB pages (1 MiB
#: per page over the tiny model's 4 layers) and lease growth in steps of 4 MiB (the
#: runtime's defaults, 2 MiB pages and 256 MiB steps, suit an 80 GiB GPU). The reserve of
#: ready pages stays: without one, every block past the mapped pages waits for a page to
#: be mapped, and clients give up where a fixed share serves them.
VLLM_POOL_ENV = {
    "KVSHARE_PAGE_SIZE": str(256 * 2**10),
    "KVSHARE_LEASE_CHUNK": str(4 * 2**20),
}

# --- the run --------------------------------------------------------------------------


def run_demo(options: DemoOptions, stream: TextIO = sys.stdout) -> DemoOutcome:
    """Run every world on one trace and return what happened (see the module doc).

    The results, the plot (``options.plot``) and the report are written before the
    children are stopped, so the servers' pools unmap while the plot is drawn.
    """
    from kvshare.demo.summary import report_lines, write_results

    began = time.monotonic()
    if options.engine == "vllm":
        _require_serving()
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
    real = options.engine == "vllm"
    agents = "the node agent" if len(elastic) == 1 else f"{len(elastic)} node agents"
    stream.write(
        f"Starting {agents} (one fake {format_bytes(config.gpu_memory_bytes)} GPU each) and "
        f"{len(worlds) * config.models} {'real vLLM' if real else 'model'} servers "
        f"({config.models} per run: {', '.join(w.name for w in worlds)}; "
        f"{'one run after the other' if real else 'all at once'})...\n"
    )
    stream.flush()
    messages: queue.Queue[Any] = queue.Queue()
    # Unix socket paths must stay short (< 108 bytes): sockets live in a short temp dir.
    with (
        tempfile.TemporaryDirectory(prefix="kvs-demo-", dir="/tmp") as run_dir,
        Children.running() as children,
    ):
        base_env = child_env()
        nodes = _start_agents(elastic, Path(run_dir), config.gpu_memory_bytes, port, base_env)
        children.agents += [node.child for node in nodes.values()]
        share = config.gpu_memory_bytes // config.models
        launch = _Launcher(
            options, trace_path, share, config.gpu_memory_bytes, base_env, messages, children
        )
        view = LiveView(
            stream,
            duration_s=config.duration_s,
            gpu_bytes=config.gpu_memory_bytes,
            models=config.models,
            interactive=None if options.live else False,
        )
        run = _Run(options, trace, nodes, {}, messages, view)
        # Simulated servers run every world at once; real ones one world at a time.
        for batch in [[w] for w in worlds] if real else [worlds]:
            servers: dict[tuple[str, int], Child] = {}
            for world in batch:  # static first: it needs no broker and sets up meanwhile
                node = nodes.get(world.name)
                if node is not None:
                    node.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
                for model in range(config.models):
                    servers[(world.name, model)] = launch.server(world, model, node)
            run.wait_ready(servers)
            running = " and ".join(w.name for w in batch)
            stream.write(f"{running}: pools up after {time.monotonic() - began:.1f} s; running.\n")
            run.collect(servers, run.start(servers))
            if real:  # its memory goes before the next world's
                stop_all(list(servers.values()))
        outcome = run.outcome()
        outcome.bound = sharing_bound(trace)
        outcome.speed = options.speed
        outcome.capacity = _capacity(options, stream)
        outcome.summary = options.output / "results.json"
        if options.plot:
            outcome.plot = _plot(outcome, options.output / "kvshare-demo.png")
        outcome.wall_s = time.monotonic() - began
        write_results(outcome, outcome.summary)
        stream.write("\n".join(report_lines(outcome, options)) + "\n")
        stream.flush()
    return outcome


def _start_agents(
    elastic: list[World], run_dir: Path, gpu_bytes: int, port: int, env: dict[str, str]
) -> dict[str, NodeAgent]:
    """A node agent per elastic world, by world name: the first serves metrics on
    ``port``, the others on free ones."""
    nodes: dict[str, NodeAgent] = {}
    for index, world in enumerate(elastic):
        metrics = port if index == 0 else pick_metrics_port(0)[0]
        place = run_dir / f"n{index}"
        nodes[world.name] = NodeAgent.start(place, gpu_bytes, metrics, env, world.policy)
    return nodes


def _require_serving() -> None:
    """Real engines need the serving environment and the tiny model (``make engines``)."""
    from kvshare.demo.serving.environment import (
        DEFAULT_SERVING,
        ServingSetupError,
        require_tiny_model,
    )

    try:
        DEFAULT_SERVING.require()
        require_tiny_model()
    except ServingSetupError as exc:
        raise DemoError(str(exc)) from None


@dataclass
class _Launcher:
    """Starts model-server processes and their reader threads."""

    options: DemoOptions
    trace_path: Path
    static_share: int
    gpu_bytes: int
    base_env: dict[str, str]
    messages: queue.Queue[Any]
    children: Children

    def server(self, world: World, model: int, node: NodeAgent | None = None) -> Child:
        """One model server of ``world`` (leased by ``node``'s broker when elastic):
        simulated, or a real vLLM server (``options.engine``)."""
        options = self.options
        pod = f"model-{model}"
        common = [*("--trace", str(self.trace_path), "--model", str(model))]
        common += [*("--mode", world.mode, "--world", world.name)]
        common += ["--sample-s", str(options.sample_s)]
        extra: dict[str, str] | None = None
        if options.engine == "vllm":
            argv = [sys.executable, "-m", "kvshare.demo.real_server", *common]
            argv += ["--cpu", str(model % (os.cpu_count() or 1)), "--pod", pod]
            argv += ["--log-dir", str(options.output)]
            argv += ["--cache-root", str(options.output / "vllm-cache")]
            argv += ["--startup-timeout", str(options.startup_timeout_s)]
            if node is not None:
                argv += ["--agent-metrics", node.metrics_url]
            extra = VLLM_POOL_ENV
        else:
            argv = [sys.executable, "-m", "kvshare.demo.server", *common]
            argv += ["--speed", str(options.speed)]
            if options.block_outer:
                argv += ["--block-outer"]
        env: dict[str, str] = {}
        if node is None:
            argv += ["--share-bytes", str(self.static_share)]
        else:
            # No cap below the GPU, and a guaranteed minimum of min_share of a share: what
            # a model holds beyond is the broker's to decide.
            kv_min = int(self.static_share * options.min_share)
            env = node.pool_env(pod, kv_max=self.gpu_bytes, kv_min=kv_min, extra=extra)
        log_path = options.output / f"server-{world.name}-{model}.log"
        environ = {**self.base_env, **env}
        child = spawn(f"{world.name} model-{model}", argv, log_path, environ, pipes=True)
        self.children.servers.append(child)
        assert child.process.stdout is not None
        threading.Thread(
            target=read_lines,
            args=((world.name, model), child.process.stdout, self.messages),
            daemon=True,
        ).start()
        return child


def _capacity(options: DemoOptions, stream: TextIO) -> CapacityReport | None:
    """Each world's capacity at the SLO on the twin's workload, when the options ask for
    it (after the live run, so that its simulation does not take the live servers' CPU)."""
    from kvshare.demo.capacity import capacity_at_slo

    if options.capacity_family is None:
        return None
    stream.write(
        f"Measuring capacity at the latency SLO in the GPU twin ({options.capacity_family})...\n"
    )
    stream.flush()
    return capacity_at_slo(options.capacity_family, duration_s=options.capacity_duration_s)


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
        capacity=outcome.capacity,
    )


@dataclass
class _Run:
    """The live part of one run: the servers' messages, the view, the broker's books.

    Owned by the orchestrator's main thread; reader threads only put into ``messages``.
    A run plays its worlds in one or more batches; messages of an earlier batch's servers
    (their last words as they stop) are dropped.
    """

    options: DemoOptions
    trace: trace_mod.Trace
    nodes: dict[str, NodeAgent]
    """The node agent of each elastic world, by world name."""
    servers: dict[tuple[str, int], Child]
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

    def wait_ready(self, servers: dict[tuple[str, int], Child]) -> None:
        """Block until the pool of each of ``servers`` is up."""
        self.servers |= servers
        ready: set[tuple[str, int]] = set()
        deadline = time.monotonic() + self.options.startup_timeout_s
        while len(ready) < len(servers):
            try:
                key, message = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = ", ".join(servers[k].name for k in servers if k not in ready)
                raise DemoError(f"timed out waiting for {late} to start") from None
            if key not in servers:
                continue
            if message is None or message.get("kind") == "error":
                raise self.fail(key, (message or {}).get("message", "exited during start-up"))
            if message.get("kind") == "ready":
                ready.add(key)

    def start(self, servers: dict[tuple[str, int], Child]) -> float:
        """Give each of ``servers`` the same start instant; returns it."""
        start = time.monotonic() + 0.2
        for child in servers.values():
            assert child.process.stdin is not None
            child.process.stdin.write(json.dumps({"start": start}) + "\n")
            child.process.stdin.flush()
        self.samples |= {key: [] for key in servers}
        return start

    def check_broker(self, start: float, worlds: set[str]) -> None:
        """One snapshot of the books of every broker of ``worlds`` from its metrics."""
        t = round((time.monotonic() - start) * self.options.speed, 3)
        for world, node in self.nodes.items():
            text = scrape(node.metrics_url) if world in worlds else None
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

    def collect(self, servers: dict[tuple[str, int], Child], start: float) -> None:
        """Until each of ``servers`` has reported: messages, broker checks, the live view."""
        config = self.trace.config
        footer = [f"metrics: {self.first.metrics_url}   output: {self.options.output}/"]
        next_scrape = next_view = 0.0
        deadline = start + config.duration_s / self.options.speed + FINISH_GRACE_S
        worlds = {world for world, _ in servers}
        while any(key not in self.results for key in servers):
            now = time.monotonic()
            if now >= next_scrape:
                self.check_broker(start, worlds)
                next_scrape = now + 0.5
            if now >= next_view:
                elapsed = max(0.0, now - start) * self.options.speed
                self.view.update(elapsed, self._shown(), footer)
                next_view = now + 0.25
            try:
                key, message = self.messages.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    late = [servers[k].name for k in servers if k not in self.results]
                    raise DemoError(f"no result from {', '.join(late)} in time") from None
                continue
            if key in servers:
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
        """Every world's results, compared with the static world's, and the checks."""
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
