"""What the demo's trace allows: its models served from partitions, and from one shared pool.

The real run moves real memory through real pools and the broker, so how much elastic
sharing gains on a trace mixes two things: what the trace leaves to gain, and how much of
that kvshare gets. :func:`sharing_bound` separates them. It runs the same scheduler
(:class:`~kvshare.demo.engine_sim.EngineSim`) for every model of the trace, each step at
its own logical time (steps cost what their batch costs), with no memory behind the
blocks:

- *partitioned*: each model allocates from its own fixed equal share of the GPU's blocks,
  as the static world does;
- *shared*: every model allocates from one allocator holding all of the GPU's blocks, and
  a block one model frees is another's at the very next allocation — sharing with no
  pages, no leases, no reclaims and no fairness between models (first come, first
  served).

No broker can move memory faster than the shared run does, so its count is what instant
sharing serves on this trace, and ``shared / partitioned`` is the ratio a reader should
hold the measured one against. (It is a reference, not a proof of optimality: a scheduler
that favoured short requests could serve more in both worlds.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.trace import Trace

__all__ = ["Bound", "sharing_bound"]


class _Blocks:
    """Block ids ``1..count`` (0 is the null block), handed out and taken back."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count, 0, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, ids: Iterable[int]) -> None:
        self._free.extend(ids)


@dataclass(frozen=True)
class Bound:
    """Requests served within the trace's duration, per model, in both simulated worlds."""

    partitioned: tuple[int, ...]
    shared: tuple[int, ...]

    @property
    def ratio(self) -> float:
        """Served shared / served partitioned."""
        total = sum(self.partitioned)
        return sum(self.shared) / total if total else float("inf")


def _serve(trace: Trace, allocators: list[_Blocks]) -> tuple[int, ...]:
    config = trace.config
    engines = [
        EngineSim(
            trace.for_model(model),
            allocators[model],
            block_tokens=config.block_tokens,
            cost=config.step_cost(),
            patience_s=config.patience_s,
        )
        for model in range(config.models)
    ]
    # The engine whose next step starts first takes it; among steps starting at the same
    # time, the engine that stepped longest ago goes first (nobody always allocates first).
    due: list[tuple[float, int, int]] = []
    order = itertools.count()
    for index, engine in enumerate(engines):
        start = engine.next_step_at()
        if start is not None and start < config.duration_s:
            heapq.heappush(due, (start, next(order), index))
    while due:
        _, _, index = heapq.heappop(due)
        engine = engines[index]
        engine.step()
        start = engine.next_step_at()
        if start is not None and start < config.duration_s:
            heapq.heappush(due, (start, next(order), index))
    return tuple(engine.stats.served for engine in engines)


def sharing_bound(trace: Trace) -> Bound:
    """Serve ``trace`` from equal partitions and from one shared pool (see the module doc)."""
    config = trace.config
    # Every real pool keeps block 0 as its null block: a share lends one block less.
    usable = config.share_blocks() - 1
    partitions = [_Blocks(usable) for _ in range(config.models)]
    pool = _Blocks(usable * config.models)
    return Bound(
        partitioned=_serve(trace, partitions),
        shared=_serve(trace, [pool] * config.models),
    )
