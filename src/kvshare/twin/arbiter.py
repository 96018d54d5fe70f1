"""Shared compute: who runs a step on the GPU, and how long it takes among the others.

Co-located engines share one GPU's compute. Each engine runs one step at a time; what
a step takes *alone* is its step table's time (:mod:`kvshare.twin.steps`). The arbiter
turns that into when each step starts and ends, on the twin's clock:

- :class:`TimeSlicing` (the default): one step runs at a time; steps that are ready
  queue first come, first served, as kernel launches from different processes do on a
  GPU without MPS (the driver time-slices between their contexts). An engine alone gets
  the whole GPU; two busy engines each get about half.
- :class:`Mps`: with NVIDIA's Multi-Process Service the steps of different engines run
  at once. *Interference model (an assumption, not a measurement)*: a step alone uses a
  fraction ``f`` of the GPU's binding resource, from the roofline: ``f = max(FLOPs /
  peak FLOP/s, bytes moved / peak bandwidth) / its alone time``, at most 1 (a decode
  step of an 8B model reads its weights at ~70 % of the H200's bandwidth and uses a few
  percent of its compute; a long prefill is compute-bound). Running steps share the
  GPU like processors share a link: while the running steps' fractions sum to ``F``,
  each progresses at ``1 / max(1, F)`` of its alone speed, so no step ever runs faster
  than alone, and two steps that together need less than the whole GPU do not slow
  each other. It ignores that two steps bound by different resources (compute and
  bandwidth) may overlap better than this, and cache and scheduling contention that
  makes them overlap worse.

An engine that is ready but finds nothing it can run (its next request does not fit in
the memory it can get, and nothing runs) does not take the GPU: it looks again after
:data:`POLL_S`, as vLLM's engine loop keeps polling its scheduler.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.sim_node import SimClock
from kvshare.demo.step_cost import StepWork
from kvshare.twin.gpus import GpuKind
from kvshare.twin.models import Footprint

__all__ = [
    "ARBITERS",
    "POLL_S",
    "AfterStep",
    "Arbiter",
    "Mps",
    "Slot",
    "TimeSlicing",
    "roofline_demand",
    "start_engines",
]

#: Seconds an engine with nothing it can run waits before its scheduler looks again.
POLL_S = 0.01


def _nothing() -> None:
    """No hook."""


@dataclass
class Slot:
    """One engine on the GPU, with what happens around each of its steps."""

    engine: EngineSim
    #: The engine's share of the binding resource for a step's work and alone time (MPS).
    demand: Callable[[StepWork, float], float] = lambda work, seconds: 1.0
    #: Called when a step starts and when it ends (the kvshare world's pool fence and
    #: maintenance pass).
    began: Callable[[], None] = field(default=_nothing)
    ended: Callable[[], None] = field(default=_nothing)

    def begin(self, now: float) -> tuple[StepWork, float]:
        """Start a step at ``now``: its work and what it takes alone."""
        work = self.engine.begin_step(now)
        self.began()
        return work, self.engine.cost.step_seconds(work)

    def end(self, now: float) -> None:
        """End the step begun last at ``now``."""
        self.engine.end_step(now)
        self.ended()


class Arbiter(Protocol):
    """Decides when the steps of the engines sharing a GPU start and end."""

    def ready(self, slot: Slot) -> None:
        """``slot``'s engine has work: run its next step as soon as the GPU allows."""


def roofline_demand(footprint: Footprint, gpu: GpuKind) -> Callable[[StepWork, float], float]:
    """The fraction of ``gpu``'s binding resource a step of ``footprint``'s model uses
    alone (see the module doc): its FLOPs and the bytes it moves at peak, over its time."""
    arch = footprint.architecture
    tp = footprint.tensor_parallel
    flops_per_token = 2 * arch.parameters / tp
    # Q.K and attention.V over each attended token, per layer and head on this GPU.
    attention_flops = 4 * arch.layers * max(1, arch.heads // tp) * arch.head_dim
    kv_bytes = footprint.kv_bytes_per_token
    weights = footprint.weight_bytes

    def demand(work: StepWork, alone_s: float) -> float:
        if alone_s <= 0:
            return 0.0
        # A causal prefill attends, on average, to half of its prompt.
        attended = work.decode_context + work.prefill_attended / 2
        flops = flops_per_token * work.tokens + attention_flops * attended
        moved = weights + kv_bytes * (work.decode_context + work.prefill_tokens)
        busy = max(flops / gpu.bf16_flops, moved / gpu.memory_bandwidth)
        return min(1.0, busy / alone_s)

    return demand


#: What an arbiter calls after each step of a slot: ``(slot, ran)``, ``ran`` false when
#: the step found nothing to run and took no GPU time.
AfterStep = Callable[[Slot, bool], None]


class TimeSlicing:
    """One step at a time, ready steps first come, first served (see the module doc)."""

    name = "time-slicing"

    def __init__(self, clock: SimClock, after_step: AfterStep) -> None:
        self._clock = clock
        self._after_step = after_step
        self._queue: deque[Slot] = deque()
        self._running: Slot | None = None

    def ready(self, slot: Slot) -> None:
        self._queue.append(slot)
        if self._running is None:
            self._next()

    def _next(self) -> None:
        while self._queue and self._running is None:
            slot = self._queue.popleft()
            now = self._clock.now
            work, alone = slot.begin(now)
            if not work.tokens:
                slot.end(now)
                self._after_step(slot, False)
                continue
            self._running = slot
            self._clock.at(now + alone, self._finish)

    def _finish(self) -> None:
        slot, self._running = self._running, None
        assert slot is not None
        slot.end(self._clock.now)
        self._after_step(slot, True)  # back in the queue behind the steps that waited
        self._next()


class _Step:
    __slots__ = ("demand", "left", "slot")

    def __init__(self, slot: Slot, left: float, demand: float) -> None:
        self.slot = slot
        self.left = left  # seconds of its alone time still to run
        self.demand = demand


class Mps:
    """Steps of different engines at once, slowed by the sum of their demands (see the
    module doc)."""

    name = "mps"

    def __init__(self, clock: SimClock, after_step: AfterStep) -> None:
        self._clock = clock
        self._after_step = after_step
        self._steps: list[_Step] = []
        self._since = 0.0
        self._plans = itertools.count()
        self._plan_in_force = -1

    def _rate(self) -> float:
        return 1.0 / max(1.0, sum(step.demand for step in self._steps))

    def _progress(self) -> None:
        """Advance every running step to now at the rate that held since the last change."""
        now = self._clock.now
        done = (now - self._since) * self._rate()
        for step in self._steps:
            step.left -= done
        self._since = now

    def ready(self, slot: Slot) -> None:
        now = self._clock.now
        work, alone = slot.begin(now)
        if not work.tokens:
            slot.end(now)
            self._after_step(slot, False)
            return
        self._progress()
        self._steps.append(_Step(slot, alone, slot.demand(work, alone)))
        self._plan()

    def _plan(self) -> None:
        """Plan the end of the step that finishes first at the current rate (a plan made
        before the running steps last changed is void)."""
        if not self._steps:
            return
        plan = next(self._plans)
        self._plan_in_force = plan
        first = max(0.0, min(step.left for step in self._steps))
        self._clock.at(self._clock.now + first / self._rate(), lambda: self._due(plan))

    def _due(self, plan: int) -> None:
        if plan != self._plan_in_force:
            return
        self._progress()
        finished = [step for step in self._steps if step.left <= 1e-12]
        self._steps = [step for step in self._steps if step.left > 1e-12]
        now = self._clock.now
        for step in finished:
            step.slot.end(now)
        for step in finished:
            self._after_step(step.slot, True)
        self._plan()


#: The arbiters by name.
ARBITERS: dict[str, Callable[[SimClock, AfterStep], TimeSlicing | Mps]] = {
    TimeSlicing.name: TimeSlicing,
    Mps.name: Mps,
}


def start_engines(clock: SimClock, sharing: str, slots: list[Slot]) -> TimeSlicing | Mps:
    """Run ``slots`` on one GPU shared by the arbiter called ``sharing``, on ``clock``:
    each engine becomes ready when it has work (at its next arrival when idle), steps
    through the arbiter, and after each step is ready again at once if it has more work,
    or after :data:`POLL_S` if its step found nothing it could run."""
    if sharing not in ARBITERS:
        raise ValueError(f"no GPU sharing called {sharing!r}; known: {', '.join(ARBITERS)}")

    def after_step(slot: Slot, ran: bool) -> None:
        start = slot.engine.next_step_at()
        if start is None:
            return
        if start > clock.now:
            clock.at(start, lambda: arbiter.ready(slot))
        elif ran:
            arbiter.ready(slot)
        else:
            clock.at(clock.now + POLL_S, lambda: arbiter.ready(slot))

    arbiter = ARBITERS[sharing](clock, after_step)
    for slot in slots:
        start = slot.engine.next_step_at()
        if start is not None:
            clock.at(start, functools.partial(arbiter.ready, slot))
    return arbiter
