"""Where the memory is while a model waits for it: one simulated elastic run, diagnosed.

The gain share says how much of what sharing allows a broker policy got; this says where
the rest went. Every ``interval_s`` of trace time, while at least one model is *starved*
(the request at the head of its queue does not fit in what its lease leaves free), a
:class:`Diagnosis` adds up, as shares of the GPU's blocks:

- *idle elsewhere*: blocks leased to the models that are not starved and not used by
  their engines (free, ready, or kept only as prefix cache): what a broker that moved
  memory at once and for free would have handed to the starved ones;
- of that, *stranded*: free blocks on pages that also hold a block in use. A pool gives
  memory back in whole pages, so these come back only once every block on their page has
  been freed, whatever the broker asks;
- *idle in starved pools*: what their own lease leaves free that their next request does
  not fit in.

``python -m kvshare.demo.elastic_sim --diagnose`` prints them per trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.demo.engine_sim import EngineSim
    from kvshare.runtime.pool import KVPool

__all__ = ["Diagnosis"]


@dataclass
class Diagnosis:
    """Samples a simulated node (a :class:`~kvshare.demo.elastic_sim.Watch`)."""

    gpu_blocks: int
    """The GPU's memory, in KV blocks: what the shares are of."""
    interval_s: float = 0.25
    samples: int = 0
    starved_samples: int = 0
    _idle_elsewhere: int = field(default=0, repr=False)
    _stranded: int = field(default=0, repr=False)
    _idle_starved: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.gpu_blocks < 1 or not self.interval_s > 0:
            raise ValueError("a diagnosis needs gpu_blocks >= 1 and interval_s > 0")

    def __call__(self, pools: Sequence[KVPool], engines: Sequence[EngineSim]) -> None:
        self.samples += 1
        looks = [_look(pool, engine) for pool, engine in zip(pools, engines, strict=True)]
        if not any(look.starved for look in looks):
            return
        self.starved_samples += 1
        for look in looks:
            if look.starved:
                self._idle_starved += look.idle
            else:
                self._idle_elsewhere += look.idle
                self._stranded += look.stranded

    def _share(self, blocks: int) -> float:
        return blocks / self.starved_samples / self.gpu_blocks if self.starved_samples else 0.0

    @property
    def starved_share(self) -> float:
        """The share of the run during which some model was starved."""
        return self.starved_samples / self.samples if self.samples else 0.0

    @property
    def idle_elsewhere(self) -> float:
        """Mean share of the GPU leased to unstarved models and unused, while one starved."""
        return self._share(self._idle_elsewhere)

    @property
    def stranded(self) -> float:
        """Of :attr:`idle_elsewhere`, the share on pages that hold a block in use."""
        return self._share(self._stranded)

    @property
    def idle_starved(self) -> float:
        """Mean share of the GPU free in the starved models' own leases."""
        return self._share(self._idle_starved)

    def summary(self) -> dict[str, float]:
        """The shares, rounded, by name."""
        return {
            "starved_share": round(self.starved_share, 3),
            "idle_elsewhere": round(self.idle_elsewhere, 3),
            "stranded": round(self.stranded, 3),
            "idle_starved": round(self.idle_starved, 3),
        }


@dataclass(frozen=True)
class _Look:
    starved: bool
    idle: int
    stranded: int


def _look(pool: KVPool, engine: EngineSim) -> _Look:
    snapshot = pool.snapshot()
    block = pool.geometry.block_bytes_all_buffers
    page = pool.geometry.page_bytes
    # The null block is in every lease and on the first page, and is never free.
    free = max(0, snapshot.limit // block - 1 - engine.used_blocks())
    need = engine.blocks_to_admit_next()
    pages_in_use = snapshot.used // page
    stranded = max(0, pages_in_use * (page // block) - 1 - snapshot.used_blocks)
    return _Look(starved=need is not None and need > free, idle=free, stranded=stranded)
