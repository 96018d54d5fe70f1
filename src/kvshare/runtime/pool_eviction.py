"""The engine's prefix cache as a pool sees it: blocks it may ask the engine to give back.

A pool over its lease first gives back its empty pages; what the engine keeps only as
prefix cache comes next. :class:`Eviction` asks the engine's :class:`Evictor` for enough
cached blocks to empty the pages the pool is over by, from the pool's maintenance (no pool
lock held: the engine synchronises with its own scheduler).
"""

from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["Eviction", "Evictor"]

log = logging.getLogger(__name__)


class Evictor(Protocol):
    """The engine's prefix cache, as the pool sees it when it must give memory back."""

    def cached_blocks(self) -> int:
        """Blocks allocated from the pool that the engine keeps only as prefix cache."""

    def evict(self, n: int) -> int:
        """Drop up to ``n`` cached blocks, freeing them through :meth:`KVPool.free`; returns
        how many were freed.

        Called from the pool's background thread while no pool lock is held: the engine
        synchronises with its own scheduler (or records the request, returns 0, and frees
        on its next step).
        """


class Eviction:
    """Asks the registered :attr:`evictor` (if any) for cached blocks; pages of the pool
    hold at most ``blocks_per_page`` blocks."""

    def __init__(self, blocks_per_page: int) -> None:
        self._blocks_per_page = blocks_per_page
        self.evictor: Evictor | None = None

    def cached_blocks(self) -> int:
        """Blocks the engine keeps only as prefix cache (0 without an evictor)."""
        evictor = self.evictor
        return evictor.cached_blocks() if evictor is not None else 0

    def run(self, over_pages: int) -> bool:
        """Ask the engine to evict cached blocks to give back ``over_pages`` pages; whether
        any went."""
        evictor = self.evictor
        if evictor is None or over_pages <= 0:
            return False
        wanted = min(evictor.cached_blocks(), over_pages * self._blocks_per_page)
        if wanted <= 0:
            return False
        freed = evictor.evict(wanted)
        log.info(
            "lease lowered: asked the engine to evict %d cached blocks, %d freed", wanted, freed
        )
        return freed > 0
