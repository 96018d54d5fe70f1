"""The elastic world of the demo in simulated time: the real broker books and policy, the
real KV pools, the real engine simulation, no processes and no sockets.

``kvshare demo`` runs every model server as a process and the broker in the node agent;
what it measures mixes kvshare's behaviour with the machine's load (its delays keep wall
time). This module runs the same code in one process on one simulated clock, so a run
depends only on the trace and on the settings below — the same result every time, on
any machine, in seconds — for trying broker policies against the trace suite. The real
run confirms what it finds.

It runs the trace on :class:`~kvshare.demo.sim_node.SimNode` (what runs for real there
and what stands in is said in :mod:`kvshare.demo.sim_node`): one pool per model with the
demo server's geometry, reserve and lease chunk, and
:class:`~kvshare.demo.engine_sim.EngineSim` with the trace's step cost, every engine
stepping at its own time, as if each had a GPU of its own.

Time: the engines keep the trace's time; kvshare's delays (the latency, the report
intervals, the slow-start window, reclaim deadlines) are wall-clock times that the demo's
speed-up multiplies (``speed``, as ``kvshare demo --speed``), so they are scaled the same
way here.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.demo import suite as suite_mod
from kvshare.demo import trace as trace_mod
from kvshare.demo.bound import Bound, paged_sharing, sharing_bound
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.server import demo_geometry, lease_chunk_bytes
from kvshare.demo.sim_diagnosis import Diagnosis
from kvshare.demo.sim_node import NodeSettings, PoolSpec, SimNode, Watch
from kvshare.demo.stats import percentile
from kvshare.deviceplugin.broker.policy import (
    DEFAULT_POLICY,
    POLICIES,
    Entitlement,
    Policy,
    policy_named,
)
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pool import KVPool

__all__ = [
    "PAGED_REFERENCE",
    "SimOptions",
    "SimResult",
    "Watch",
    "blocks_per_page",
    "paged_reference",
    "simulate",
    "summarise",
]

#: The host backend's mapping granularity, whose geometry the demo's pools use.
_GRANULARITY = mmap.PAGESIZE
#: The name :func:`summarise` gives the instant page-sharing reference.
PAGED_REFERENCE = "instant-pages"


@dataclass(frozen=True)
class SimOptions:
    """What the simulated node runs with."""

    policy: str = DEFAULT_POLICY
    #: Every pool's kvCache.min, as a fraction of an equal share of the GPU.
    kv_min_share: float = 0.0
    #: Wall seconds a message takes from a pool to the broker or back (thread wake-ups
    #: included).
    latency_s: float = 0.001
    #: Trace seconds per wall second (the demo's ``--speed``).
    speed: float = 4.0
    #: Seconds a pool has to honour a reclaim (the node agent's default).
    reclaim_deadline_s: float = 10.0
    #: Blocks per physical page of every pool (None: the demo server's pages).
    page_blocks: int | None = None
    #: Ready pages every pool keeps mapped ahead of its engine (None: the demo server's,
    #: the pool's default).
    reserve_pages: int | None = None
    #: The entitlement policy's headroom, as a share of an entitlement (None: its
    #: default); only for that policy.
    headroom_share: float | None = None

    def __post_init__(self) -> None:
        # Every setting is refused here, before a trace runs: a NaN or infinite delay
        # stalls the clock and serves nothing, which would read as a policy's result.
        for name, value, positive in (
            ("speed", self.speed, True),
            ("reclaim deadline", self.reclaim_deadline_s, True),
            ("latency", self.latency_s, False),
        ):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"the {name} must be finite and {bound}, not {value}")
        # Above 1 the pools' minimums together exceed the GPU: the broker refuses a pool.
        if not 0 <= self.kv_min_share <= 1:
            raise ValueError(
                f"the kvCache.min share must be within [0, 1] of an equal share, "
                f"not {self.kv_min_share}"
            )
        if self.page_blocks is not None and self.page_blocks < 1:
            raise ValueError(f"the blocks per page must be >= 1, not {self.page_blocks}")
        if self.reserve_pages is not None and self.reserve_pages < 0:
            raise ValueError(f"the reserve must be >= 0 pages, not {self.reserve_pages}")

    def broker_policy(self) -> Policy:
        """A fresh instance of the policy these options name, with their settings."""
        if self.headroom_share is None:
            return policy_named(self.policy)
        if self.policy != Entitlement.name:
            raise ValueError(f"a headroom share is a setting of {Entitlement.name!r} only")
        return Entitlement(headroom_share=self.headroom_share)


@dataclass(frozen=True)
class SimResult:
    """What the simulated elastic world served, beside what the trace allows."""

    served: tuple[int, ...]
    abandoned: tuple[int, ...]
    p99_wait_s: float
    bound: Bound

    @property
    def gain_share(self) -> float:
        """(elastic - static) / (shared bound - static): the part of what sharing could
        gain on this trace that was gained."""
        static, shared = sum(self.bound.partitioned), sum(self.bound.shared)
        if shared <= static:
            return 1.0 if sum(self.served) >= static else 0.0
        return (sum(self.served) - static) / (shared - static)

    def worst_model(self) -> tuple[int, float]:
        """The model served least against ``min(its static count, its count in the shared
        bound)``, and that ratio."""
        ratios = [
            (served / floor if floor else 1.0, model)
            for model, (served, floor) in enumerate(
                zip(
                    self.served,
                    map(min, self.bound.partitioned, self.bound.shared),
                    strict=True,
                )
            )
        ]
        ratio, model = min(ratios)
        return model, ratio


def _node(trace: trace_mod.Trace, options: SimOptions) -> SimNode:
    """The simulated node of ``trace``'s GPU: one pool per model with the demo server's
    geometry, lease chunk and step cost, every engine on its own clock."""
    config = trace.config
    geometry = _pool_geometry(config, options.page_blocks)
    chunk = lease_chunk_bytes(config, geometry)
    kv_min = int(config.gpu_memory_bytes // config.models * options.kv_min_share)
    specs = [
        PoolSpec(f"model-{model}", geometry, chunk, kv_min, config.gpu_memory_bytes)
        for model in range(config.models)
    ]
    settings = NodeSettings(
        gpu_bytes=config.gpu_memory_bytes,
        granularity=_GRANULARITY,
        latency_s=options.latency_s,
        speed=options.speed,
        reclaim_deadline_s=options.reclaim_deadline_s,
        reserve_pages=options.reserve_pages,
    )

    def engine(model: int, pool: KVPool) -> EngineSim:
        return EngineSim(
            trace.for_model(model),
            pool,
            block_tokens=config.block_tokens,
            cost=config.step_cost(),
            patience_s=config.patience_s,
        )

    return SimNode(settings, options.broker_policy(), specs, engine)


def simulate(
    trace: trace_mod.Trace,
    options: SimOptions | None = None,
    bound: Bound | None = None,
    *,
    watch: Watch | None = None,
) -> SimResult:
    """Run the elastic world of ``trace`` in simulated time (see the module doc);
    ``watch``, if given, samples it as it runs."""
    node = _node(trace, options or SimOptions())
    try:
        node.start(own_clocks=True)
        if watch is not None:
            node.watch(watch)
        node.clock.run_until(trace.config.duration_s)
        engines = node.engines
        waits = [w for e in engines for w in e.waits()[0]]
        node.books.check()
        return SimResult(
            served=tuple(e.stats.served for e in engines),
            abandoned=tuple(e.stats.abandoned for e in engines),
            p99_wait_s=percentile(waits, 99),
            bound=bound or sharing_bound(trace),
        )
    finally:
        node.close()


def _pool_geometry(config: trace_mod.TraceConfig, page_blocks: int | None) -> KVGeometry:
    """Every simulated pool's geometry: the demo server's, over the host backend's
    granularity, with pages of ``page_blocks`` blocks if given."""
    return demo_geometry(config, _GRANULARITY, page_blocks)


def blocks_per_page(config: trace_mod.TraceConfig, page_blocks: int | None = None) -> int:
    """Blocks one physical page of the simulated pools holds (``page_blocks``, or the demo
    server's pages)."""
    geometry = _pool_geometry(config, page_blocks)
    return geometry.page_size // geometry.block_bytes


def paged_reference(
    trace: trace_mod.Trace, bound: Bound, page_blocks: int | None = None
) -> SimResult:
    """What first-come sharing in whole pages serves on ``trace``, instantly and with no
    policy (:func:`~kvshare.demo.bound.paged_sharing`), as a result beside the elastic
    world's: its gain share is the part of the shared bound that pages alone allow."""
    served = paged_sharing(trace, blocks_per_page(trace.config, page_blocks))
    return SimResult(served=served, abandoned=(), p99_wait_s=float("nan"), bound=bound)


def summarise(results: Sequence[tuple[str, SimResult]]) -> dict[str, dict[str, float]]:
    """Per policy, over ``(policy, result)`` pairs: the mean, median and least gain share,
    the least worst-model ratio, and how many traces left a model below 0.9 of its due."""
    summary: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(policy for policy, _ in results):
        gains = [r.gain_share for policy, r in results if policy == name]
        worst = [r.worst_model()[1] for policy, r in results if policy == name]
        summary[name] = {
            "traces": len(gains),
            "gain_mean": round(statistics.fmean(gains), 3),
            "gain_median": round(statistics.median(gains), 3),
            "gain_min": round(min(gains), 3),
            "worst_min": round(min(worst), 3),
            "below_0.9": sum(w < 0.9 for w in worst),
        }
    return summary


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES))
    parser.add_argument("--family", action="append", help="only these families")
    parser.add_argument(
        "--seeds",
        type=int,
        help="seeds 0..N-1 of every family instead of the suite's own (more traffic than "
        "the real suite runs)",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="with --seeds: start at this seed instead of 0 (seeds a policy was not tuned on)",
    )
    parser.add_argument("--kv-min-share", type=float, default=0.0)
    parser.add_argument(
        "--fixed-steps",
        action="store_true",
        help="engines whose every step takes its fixed time whatever its batch (the demo's "
        "engine before it was calibrated), to compare with figures measured on them",
    )
    parser.add_argument(
        "--page-blocks",
        type=int,
        help="blocks per physical page of every pool (default: the demo server's pages; 1 is "
        "a block-outer KV layout whose page holds one block of every layer)",
    )
    parser.add_argument(
        "--paged-bound",
        action="store_true",
        help=f"also run first-come sharing in whole pages, instantly and with no policy "
        f"({PAGED_REFERENCE}): what pages alone allow of the shared bound",
    )
    parser.add_argument(
        "--reserve-pages",
        type=int,
        default=SimOptions.reserve_pages,
        help="ready pages every pool keeps mapped ahead of its engine (default: the pages "
        "that hold 4 blocks)",
    )
    parser.add_argument(
        "--headroom-share",
        type=float,
        help="the entitlement policy's headroom, as a share of an entitlement",
    )
    parser.add_argument("--latency", type=float, default=SimOptions.latency_s)
    parser.add_argument(
        "--speed",
        type=float,
        default=SimOptions.speed,
        help="trace seconds per wall second: every kvshare delay is wall time, the reclaim "
        "deadline too, so a lower speed gives pools less trace time to honour a reclaim",
    )
    parser.add_argument(
        "--reclaim-deadline",
        type=float,
        default=SimOptions.reclaim_deadline_s,
        help="wall seconds a pool has to honour a reclaim (the node agent's setting)",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also say where the memory was while a model was starved (sim_diagnosis)",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command's arguments, each checked (argparse exits on a bad one)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, not {args.seeds}")
    for name in args.policy or [DEFAULT_POLICY]:
        try:  # a setting the simulator or a policy refuses is refused before any trace runs
            _options(args, name).broker_policy()
        except ValueError as refused:
            parser.error(str(refused))
    if args.first_seed < 0 or (args.first_seed and args.seeds is None):
        parser.error(f"--first-seed must be >= 0 and comes with --seeds, not {args.first_seed}")
    return args


def _options(args: argparse.Namespace, policy: str) -> SimOptions:
    """The simulator's options for ``policy`` from the command's settings."""
    return SimOptions(
        policy=policy,
        kv_min_share=args.kv_min_share,
        latency_s=args.latency,
        speed=args.speed,
        reclaim_deadline_s=args.reclaim_deadline,
        page_blocks=args.page_blocks,
        reserve_pages=args.reserve_pages,
        headroom_share=args.headroom_share,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m kvshare.demo.elastic_sim``: the suite (or some of it) in simulated time."""
    args = _parse(argv)
    rows = []
    results: list[tuple[str, SimResult]] = []
    setup = suite_mod.SETUP.with_fixed_steps() if args.fixed_steps else suite_mod.SETUP
    seeds = None if args.seeds is None else range(args.first_seed, args.first_seed + args.seeds)
    for made in suite_mod.suite(setup, seeds=seeds):
        if args.family and made.family not in args.family:
            continue
        bound = sharing_bound(made.trace)
        if args.paged_bound:
            paged = paged_reference(made.trace, bound, args.page_blocks)
            results.append((PAGED_REFERENCE, paged))
            model, worst = paged.worst_model()
            print(
                f"{made.name:<16} {PAGED_REFERENCE:<13} served {sum(paged.served):>5} gain "
                f"{paged.gain_share:>6.2f} worst model-{model} {worst:.2f}",
                flush=True,
            )
        for name in args.policy or [DEFAULT_POLICY]:
            options = _options(args, name)
            config = made.trace.config
            diagnosis = (
                Diagnosis(config.gpu_memory_bytes // config.block_bytes())
                if args.diagnose
                else None
            )
            result = simulate(made.trace, options, bound, watch=diagnosis)
            results.append((name, result))
            model, worst = result.worst_model()
            rows.append(
                {
                    "trace": made.name,
                    "policy": name,
                    "static": sum(bound.partitioned),
                    "elastic": sum(result.served),
                    "shared": sum(bound.shared),
                    "gain_share": round(result.gain_share, 3),
                    "worst_model": model,
                    "worst_ratio": round(worst, 3),
                    "p99_wait_s": round(result.p99_wait_s, 2),
                }
            )
            row = rows[-1]
            print(
                f"{row['trace']:<16} {name:<13} static {row['static']:>5} elastic "
                f"{row['elastic']:>5} shared {row['shared']:>5} gain {row['gain_share']:>6.2f} "
                f"worst model-{model} {worst:.2f} p99 {row['p99_wait_s']:.2f} s",
                flush=True,
            )
            if diagnosis is not None:
                row["diagnosis"] = diagnosis.summary()
                print(
                    f"{'':<16} {'':<13} starved {diagnosis.starved_share:.0%} of the time; "
                    f"meanwhile idle elsewhere {diagnosis.idle_elsewhere:.1%} of the GPU "
                    f"(stranded {diagnosis.stranded:.1%}), idle in the starved pools "
                    f"{diagnosis.idle_starved:.1%}",
                    flush=True,
                )
    summary = summarise(results)
    for name, numbers in summary.items():
        print(
            f"{name}: {numbers['traces']:.0f} traces, gain share mean {numbers['gain_mean']:.2f} "
            f"median {numbers['gain_median']:.2f} min {numbers['gain_min']:.2f}; worst model "
            f"{numbers['worst_min']:.2f}, {numbers['below_0.9']:.0f} traces with a model below 0.9",
            flush=True,
        )
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
