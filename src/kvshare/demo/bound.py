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

:func:`paged_sharing` is the same first-come sharing at the granularity kvshare moves
memory in: physical pages of several blocks. Each model allocates from the free blocks
of the pages it holds first (the fullest page that fits, as the pool does), takes whole
free pages from the GPU when those run out, and gives a page back the moment its last
block is freed — still instant, with no leases, no broker and no fairness. What it
serves against the shared run is what pages alone cost on the trace, before any policy:
a model that keeps some blocks of a page in use keeps the whole page, and a busy model
whose freed blocks land on pages it still holds takes them again at its next step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvshare.demo.blocks import BlockAllocator, ModelShare
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.trace import Trace

__all__ = ["Bound", "FixedBlocks", "paged_sharing", "sharing_bound"]


class FixedBlocks:
    """Block ids ``1..count`` (0 is the null block), handed out and taken back."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count, 0, -1))

    def alloc(self, n: int, *, running: bool = False) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, ids: Iterable[int]) -> None:
        self._free.extend(ids)

    def expect_blocks(self, count: int) -> None:
        """Nothing to keep pages for: this world has no lease."""


class _PagePool:
    """The GPU's blocks in pages of ``blocks_per_page``, shared first come, first served
    page by page (see the module doc). Block ids are ``1..``; page ``p`` holds ids
    ``p * blocks_per_page + 1 ..``."""

    def __init__(self, pages: int, blocks_per_page: int, models: int) -> None:
        self._per_page = blocks_per_page
        self._free_pages = list(range(pages - 1, -1, -1))
        self._in_use = [0] * pages
        # Per model: page -> its free block ids (pages the model holds, some block free).
        self._open: list[dict[int, list[int]]] = [{} for _ in range(models)]
        self._free_in_open = [0] * models

    def view(self, model: int) -> ModelShare:
        """The allocator one model's engine uses."""
        return ModelShare(self, model)

    def alloc(self, model: int, n: int) -> list[int] | None:
        """``n`` block ids for ``model``, or None (nothing taken) when its pages and the
        GPU's free pages together hold fewer."""
        short = n - self._free_in_open[model]
        new_pages = -(-short // self._per_page) if short > 0 else 0
        if new_pages > len(self._free_pages):
            return None
        opened = self._open[model]
        for _ in range(new_pages):
            page = self._free_pages.pop()
            first = page * self._per_page + 1
            opened[page] = list(range(first + self._per_page - 1, first - 1, -1))
            self._free_in_open[model] += self._per_page
        taken: list[int] = []
        while len(taken) < n:
            wanted = n - len(taken)
            # The fullest page that fits the rest, else the fullest page.
            page = min(opened, key=lambda p: (len(opened[p]) < wanted, len(opened[p]), p))
            ids = opened[page]
            take = min(wanted, len(ids))
            taken += ids[-take:]
            del ids[-take:]
            self._in_use[page] += take
            if not ids:
                del opened[page]
        self._free_in_open[model] -= n
        return taken

    def free(self, model: int, ids: Iterable[int]) -> None:
        """Give ``model``'s blocks back; a page whose last block this frees goes back to
        the GPU."""
        opened = self._open[model]
        for block in ids:
            page = (block - 1) // self._per_page
            self._in_use[page] -= 1
            if self._in_use[page] == 0:
                self._free_in_open[model] -= len(opened.pop(page, ()))
                self._free_pages.append(page)
            else:
                opened.setdefault(page, []).append(block)
                self._free_in_open[model] += 1


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


def _serve(trace: Trace, allocators: Sequence[BlockAllocator]) -> tuple[int, ...]:
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
    partitions = [FixedBlocks(usable) for _ in range(config.models)]
    pool = FixedBlocks(usable * config.models)
    return Bound(
        partitioned=_serve(trace, partitions),
        shared=_serve(trace, [pool] * config.models),
    )


def paged_sharing(trace: Trace, blocks_per_page: int) -> tuple[int, ...]:
    """Requests served per model when every model shares the GPU's blocks first come,
    first served, but only in whole pages of ``blocks_per_page`` (see the module doc)."""
    if blocks_per_page < 1:
        raise ValueError(f"blocks_per_page must be >= 1, not {blocks_per_page}")
    config = trace.config
    # The same blocks as the shared run, rounded down to whole pages.
    pages = (config.share_blocks() - 1) * config.models // blocks_per_page
    pool = _PagePool(pages, blocks_per_page, config.models)
    return _serve(trace, [pool.view(model) for model in range(config.models)])
