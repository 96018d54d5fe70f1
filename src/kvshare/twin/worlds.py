"""Four ways to share one GPU's KV memory, run on the same workload with the same engines
and the same arbiter of the GPU's compute.

- :func:`static`: fixed equal KV shares of the GPU's KV budget, what
  ``--gpu-memory-utilization`` gives each server today. A share that cannot hold a
  model's longest request is a server vLLM refuses to start: that world serves nothing.
- :func:`first_come`: kvcached alone. Each engine maps free pages while the GPU has
  any and returns a page only once it is empty; no broker, no reclaim
  (:class:`~kvshare.twin.allocators.FirstComePages`, instant).
- :func:`kvshare`: kvshare's broker (the real :class:`~kvshare.deviceplugin.broker.books.Books`
  and a policy of :data:`~kvshare.deviceplugin.broker.policy.POLICIES`), real
  :class:`~kvshare.runtime.pool.KVPool` objects and the pools' lease conversation on the
  simulated clock (:class:`~kvshare.demo.sim_node.SimNode`, as ``elastic_sim`` runs them).
- :func:`pooled_bound`: one pool of blocks any engine takes from at once: what no way of
  moving memory between engines can beat.

The KV budget is the same in every world: the GPU's usable memory
(:data:`~kvshare.twin.gpus.GPU_MEMORY_UTILIZATION`) less every model's static footprint
(:mod:`kvshare.twin.models`). Each engine is a vLLM-style scheduler
(:class:`~kvshare.demo.engine_sim.EngineSim`) with vLLM's defaults for the GPU
(``max_num_batched_tokens``, ``max_num_seqs``, chunked prefill, 16-token blocks), its
step times from the model's step table, and its steps placed by the arbiter
(:mod:`kvshare.twin.arbiter`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshare.demo.blocks import BlockAllocator
from kvshare.demo.bound import FixedBlocks
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.sim_node import NodeSettings, PoolSpec, SimClock, SimNode
from kvshare.demo.trace import Request
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY, POLICIES, policy_named
from kvshare.runtime.pool import KVPool
from kvshare.twin.allocators import FirstComePages, SharedBytes
from kvshare.twin.arbiter import ARBITERS, Slot, start_engines
from kvshare.twin.device import Device, device_named
from kvshare.twin.models import DoesNotFitError, Footprint, check_fits
from kvshare.twin.pages import PAGE_LAYOUTS, PageLayout, PoolShape, pool_shape
from kvshare.twin.slo import PATIENCE_S, RequestRecord, SloMonitor, SloVerdict
from kvshare.twin.workload import Workload

__all__ = [
    "WORLDS",
    "Placement",
    "TwinOptions",
    "WorldResult",
    "first_come",
    "kvshare",
    "place",
    "pooled_bound",
    "run_world",
    "static",
    "world_names",
]

#: Seconds a run may go on after its last arrival (and the clients' patience) before
#: the requests still unserved count as given up.
DRAIN_S = 600.0


@dataclass(frozen=True)
class TwinOptions:
    """How the twin runs a workload (the same in every world)."""

    #: How the engines share the GPU's compute (:data:`~kvshare.twin.arbiter.ARBITERS`).
    sharing: str = "time-slicing"
    #: The KV pools' page layout (:data:`~kvshare.twin.pages.PAGE_LAYOUTS`).
    page_layout: PageLayout = "block-outer"
    #: Seconds a client waits for its first token before it gives up.
    patience_s: float = PATIENCE_S
    #: kvshare: every pool's kvCache.min, as a share of an equal share of the KV budget.
    kv_min_share: float = 0.0
    #: kvshare: seconds a message takes between a pool and the broker, each way.
    latency_s: float = 0.001
    #: kvshare: seconds a pool has to honour a reclaim (the node agent's default).
    reclaim_deadline_s: float = 10.0
    #: Stop a run as soon as the SLO is certainly missed (False: run every request, so
    #: that the verdict's attainment counts all of them).
    judge_early: bool = True

    def __post_init__(self) -> None:
        if self.sharing not in ARBITERS:
            raise ValueError(f"sharing must be one of {', '.join(ARBITERS)}, not {self.sharing!r}")
        if self.page_layout not in PAGE_LAYOUTS:
            raise ValueError(f"page_layout must be one of {', '.join(PAGE_LAYOUTS)}")
        if not 0 <= self.kv_min_share <= 1:
            raise ValueError(f"kv_min_share must be within [0, 1], not {self.kv_min_share}")
        for name in ("patience_s", "latency_s", "reclaim_deadline_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "latency_s"):
                raise ValueError(f"{name} must be a finite positive number, not {value}")


@dataclass(frozen=True)
class Placement:
    """The workload's models on its device: what each keeps, and the KV budget they share."""

    device: Device
    footprints: tuple[Footprint, ...]
    budget_bytes: int
    #: Per model, the blocks its longest request needs.
    longest_blocks: tuple[int, ...]

    @property
    def share_bytes(self) -> int:
        """One equal share of the KV budget."""
        return self.budget_bytes // len(self.footprints)


@dataclass(frozen=True)
class WorldResult:
    """What one world did with a workload."""

    world: str
    verdict: SloVerdict
    #: Simulated seconds the run lasted, and the engines' steps in all.
    sim_s: float
    steps: int
    #: Why the world served nothing, when it could not start.
    note: str = ""
    #: Every request judged, in the order they were (those never judged are absent).
    records: tuple[RequestRecord, ...] = ()


def place(workload: Workload) -> Placement:
    """Where the workload's models go: their footprints on its GPU and their KV budget;
    :class:`~kvshare.twin.models.DoesNotFitError` when one GPU cannot hold them."""
    device = device_named(workload.gpu)
    footprints = tuple(device.footprint(spec) for spec in workload.models)
    longest = [0] * len(footprints)
    index = {spec.name: i for i, spec in enumerate(workload.models)}
    for request in workload.requests:
        m = index[request.model]
        longest[m] = max(longest[m], request.prompt_tokens + request.output_tokens)
    blocks = tuple(
        -(-tokens // item.block_tokens) for tokens, item in zip(longest, footprints, strict=True)
    )
    needed = [n * item.block_bytes for n, item in zip(blocks, footprints, strict=True)]
    return Placement(device, footprints, check_fits(footprints, device, needed), blocks)


def _requests(workload: Workload) -> list[list[Request]]:
    """Per model, its requests as the engine reads them (numbered in arrival order)."""
    index = {spec.name: i for i, spec in enumerate(workload.models)}
    per_model: list[list[Request]] = [[] for _ in workload.models]
    for rid, r in enumerate(workload.requests):
        m = index[r.model]
        per_model[m].append(
            Request(rid, m, r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_tokens)
        )
    return per_model


class _Run:
    """One world's run: the engines, the SLO monitor, and the clock they share."""

    def __init__(self, workload: Workload, options: TwinOptions, placement: Placement) -> None:
        self.workload = workload
        self.options = options
        self.placement = placement
        self.requests = _requests(workload)
        index = {spec.name: i for i, spec in enumerate(workload.models)}
        self.monitor = SloMonitor(
            workload.slo,
            [index[r.model] for r in workload.requests],
            len(workload.models),
            judge_early=options.judge_early,
        )

    def engine(self, model: int, allocator: BlockAllocator) -> EngineSim:
        """Model ``model``'s engine over ``allocator``."""
        device = self.placement.device
        return EngineSim(
            self.requests[model],
            allocator,
            block_tokens=self.placement.footprints[model].block_tokens,
            cost=device.cost(self.workload.models[model]),
            patience_s=self.options.patience_s,
            limits=device.limits(),
            observer=self.monitor,
        )

    def run(
        self,
        world: str,
        clock: SimClock,
        engines: Sequence[EngineSim],
        hooks: Callable[[int], tuple[Callable[[], None], Callable[[], None]]] | None = None,
    ) -> WorldResult:
        """Run ``engines`` on the device's compute units (model ``m`` on unit ``m % units``,
        each shared by its own arbiter) until every request is judged, the SLO is
        certainly missed, or the run has drained past its last arrival."""
        device = self.placement.device
        units: list[list[Slot]] = [[] for _ in range(device.compute_units)]
        for model, engine in enumerate(engines):
            slot = Slot(engine, device.demand(self.placement.footprints[model]))
            if hooks is not None:
                slot.began, slot.ended = hooks(model)
            units[model % device.compute_units].append(slot)
        for slots in units:
            start_engines(clock, self.options.sharing, slots)
        self.monitor.watch(clock, engines)
        last = max((r.arrival_s for r in self.workload.requests), default=0.0)
        clock.run_until(last + self.options.patience_s + DRAIN_S)
        return WorldResult(
            world,
            self.monitor.verdict(),
            sim_s=clock.now,
            steps=sum(engine.steps for engine in engines),
            records=tuple(self.monitor.records),
        )


def static(workload: Workload, options: TwinOptions) -> WorldResult:
    """Fixed equal KV shares of the GPU's KV budget (see the module doc)."""
    placement = place(workload)
    run = _Run(workload, options, placement)
    engines = []
    for model, item in enumerate(placement.footprints):
        blocks = placement.share_bytes // item.block_bytes - 1  # less the null block
        if blocks < placement.longest_blocks[model]:
            return _cannot_start(
                run,
                f"static: an equal share ({placement.share_bytes / 2**30:.1f} GiB) holds "
                f"{blocks} blocks of model {item.model}, whose longest request needs "
                f"{placement.longest_blocks[model]}: vLLM would not start",
            )
        engines.append(run.engine(model, FixedBlocks(blocks)))
    return run.run("static", SimClock(), engines)


def first_come(workload: Workload, options: TwinOptions) -> WorldResult:
    """kvcached alone: whole pages of ``options.page_layout``, first come, returned only
    when empty (see the module doc)."""
    placement = place(workload)
    run = _Run(workload, options, placement)
    shapes = _shapes(placement, options.page_layout)
    # Each engine keeps its null block; the rest of the budget is free for pages.
    usable = placement.budget_bytes - sum(shape.block_bytes for shape in shapes)
    pool = FirstComePages(
        usable, [shape.page_bytes for shape in shapes], [s.blocks_per_page for s in shapes]
    )
    engines = [run.engine(m, pool.view(m)) for m in range(len(shapes))]
    return run.run("first-come", SimClock(), engines)


def pooled_bound(workload: Workload, options: TwinOptions) -> WorldResult:
    """One pool any engine takes blocks from instantly (see the module doc)."""
    placement = place(workload)
    run = _Run(workload, options, placement)
    sizes = [item.block_bytes for item in placement.footprints]
    pool = SharedBytes(placement.budget_bytes - sum(sizes), sizes)
    engines = [run.engine(m, pool.view(m)) for m in range(len(sizes))]
    return run.run("pooled-bound", SimClock(), engines)


def kvshare(workload: Workload, options: TwinOptions, policy: str = DEFAULT_POLICY) -> WorldResult:
    """kvshare's broker, pools and lease conversation on the twin's clock (see the
    module doc), under broker ``policy``."""
    placement = place(workload)
    run = _Run(workload, options, placement)
    shapes = _shapes(placement, options.page_layout)
    device = placement.device
    kv_min = int(placement.share_bytes * options.kv_min_share)
    specs = [
        PoolSpec(
            name=item.model,
            geometry=shape.geometry,
            chunk_bytes=shape.chunk_bytes,
            # At least the page of its null block, which the pool keeps from the start.
            kv_min=max(shape.page_bytes, kv_min // shape.page_bytes * shape.page_bytes),
            kv_max=placement.budget_bytes,
            static_bytes=item.static_bytes,
        )
        for item, shape in zip(placement.footprints, shapes, strict=True)
    ]
    settings = NodeSettings(
        gpu_bytes=device.memory_bytes,
        headroom_bytes=device.memory_bytes - device.usable_bytes,
        latency_s=options.latency_s,
        reclaim_deadline_s=options.reclaim_deadline_s,
        maintain_when_woken=True,
        granularity=device.page_granule,
    )

    def make_engine(model: int, pool: KVPool) -> EngineSim:
        return run.engine(model, pool)

    node = SimNode(settings, policy_named(policy), specs, make_engine)
    try:
        node.start(own_clocks=False)

        def hooks(model: int) -> tuple[Callable[[], None], Callable[[], None]]:
            return (
                functools.partial(node.step_began, model),
                functools.partial(node.step_ended, model),
            )

        result = run.run(f"kvshare:{policy}", node.clock, node.engines, hooks)
        node.books.check()
        return result
    finally:
        node.close()


def _shapes(placement: Placement, layout: PageLayout) -> list[PoolShape]:
    device = placement.device
    return [
        pool_shape(
            item,
            placement.budget_bytes,
            layout,
            granule=device.page_granule,
            lease_chunk_bytes=device.lease_chunk_bytes,
        )
        for item in placement.footprints
    ]


def _cannot_start(run: _Run, why: str) -> WorldResult:
    clock = SimClock()
    run.monitor.watch(clock, [])
    return WorldResult("static", run.monitor.verdict(), sim_s=0.0, steps=0, note=why)


#: The worlds by name: ``kvshare`` runs the broker's default policy, ``kvshare:<name>``
#: another of :data:`~kvshare.deviceplugin.broker.policy.POLICIES`.
WORLDS: dict[str, Callable[[Workload, TwinOptions], WorldResult]] = {
    "static": static,
    "first-come": first_come,
    "kvshare": kvshare,
    **{f"kvshare:{name}": functools.partial(kvshare, policy=name) for name in sorted(POLICIES)},
    "pooled-bound": pooled_bound,
}


def world_names(policies: Sequence[str] = (DEFAULT_POLICY,)) -> list[str]:
    """The four worlds, kvshare once per policy in ``policies``."""
    return ["static", "first-come", *(f"kvshare:{p}" for p in policies), "pooled-bound"]


def run_world(name: str, workload: Workload, options: TwinOptions) -> WorldResult:
    """Run the world called ``name`` (:data:`WORLDS`); a workload one GPU cannot hold
    serves nothing in any world."""
    if name not in WORLDS:
        raise ValueError(f"no world called {name!r}; known: {', '.join(WORLDS)}")
    try:
        return WORLDS[name](workload, options)
    except DoesNotFitError as refused:
        run_requests = len(workload.requests)
        verdict = SloVerdict(False, run_requests, math.inf, math.inf, (0.0,), run_requests)
        return WorldResult(name, verdict, sim_s=0.0, steps=0, note=str(refused))
