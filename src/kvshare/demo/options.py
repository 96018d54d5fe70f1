"""What a demo runs and what it produced: the options of ``kvshare demo`` (and of the
``elastic`` benchmarks) and the outcome :func:`kvshare.demo.orchestrator.run_demo`
returns, apart from the orchestrator that runs them so that what reads an outcome
(:mod:`kvshare.demo.summary`) needs nothing of the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvshare.api import names
from kvshare.demo import trace as trace_mod
from kvshare.demo.bound import Bound
from kvshare.demo.stats import BookViolation, Comparison, Mode, ServerResult

if TYPE_CHECKING:
    from kvshare.demo.capacity import CapacityReport

__all__ = [
    "DEFAULT_SPEED",
    "ENGINES",
    "DemoOptions",
    "DemoOutcome",
    "Engine",
    "World",
]

#: Seconds allowed for a node agent and every simulated server to come up.
STARTUP_TIMEOUT_S = 90.0
#: Seconds allowed for a world of real vLLM servers to come up (their start-up turns
#: follow one another, on two loaded cores).
VLLM_STARTUP_TIMEOUT_S = 600.0
#: The model servers a demo runs: simulated engines, or real vLLM servers.
Engine = Literal["sim", "vllm"]
ENGINES: tuple[Engine, ...] = ("sim", "vllm")
#: A real server's guaranteed KV memory, in equal shares: a quiet model whose few requests
#: must wait for the broker to reclaim memory from a busy one makes vLLM's engine spin on
#: the cores the busy model computes on (on CPU the cores are the accelerator too).
VLLM_MIN_SHARE = 0.25
#: The trace runs this many times as fast as the wall clock, so that bursts of production
#: length fit a one-minute demo: the default 144 s trace takes 36 s. The engines keep the
#: trace's time; kvshare (broker round trips, reclaim deadlines, the pools' reserve and
#: report threads) keeps wall time, so every delay of its counts four times over in the
#: trace's time: the speed-up handicaps elastic sharing, it never helps it.
DEFAULT_SPEED = 4.0


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
    #: Trace seconds per wall-clock second (see :data:`DEFAULT_SPEED`; 1 for real engines).
    speed: float = DEFAULT_SPEED
    engine: Engine = "sim"
    #: One elastic world per broker policy, each with its own node agent (None: the node
    #: agent's default policy). The first is the one the live view and the plot show.
    policies: tuple[str | None, ...] = (None,)
    #: Every elastic pool's kvCache.min, as a fraction of an equal share of the GPU (None:
    #: the engine's default, :attr:`min_share`).
    kv_min_share: float | None = None
    #: The twin's workload family whose capacity at the SLO the run reports per world
    #: (:mod:`kvshare.demo.capacity`; None: none), and its simulated seconds.
    capacity_family: str | None = None
    capacity_duration_s: float = 120.0
    #: The simulated servers' pools paged by the block (one buffer of all layers, as vLLM's
    #: block-outer layouts are), not the demo's per-layer pages of several blocks.
    block_outer: bool = False

    @property
    def min_share(self) -> float:
        """Every elastic pool's kvCache.min in equal shares: 0 for the simulated engines
        (what a model holds is the broker's to decide), :data:`VLLM_MIN_SHARE` for real
        ones."""
        if self.kv_min_share is not None:
            return self.kv_min_share
        return VLLM_MIN_SHARE if self.engine == "vllm" else 0.0

    @property
    def startup_timeout_s(self) -> float:
        """Seconds a world's servers have to come up."""
        return VLLM_STARTUP_TIMEOUT_S if self.engine == "vllm" else STARTUP_TIMEOUT_S

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
        if self.engine == "vllm":
            from kvshare.demo.real_server import trace_config

            return trace_mod.generate(
                trace_config(
                    seed=self.seed,
                    duration_s=self.duration_s,
                    models=self.models,
                    gpu_memory_bytes=self.gpu_memory_bytes,
                    patience_s=self.patience_s,
                )
            )
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
    capacity: CapacityReport | None = None
    """Capacity at the latency SLO per world, from the GPU twin (the headline)."""
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
