"""Who decides which pages a tensor-parallel group maps: an explicit choice, never inferred.

- :class:`LocalOwnership` — each rank's pool maps and unmaps only its own pages (SGLang:
  one scheduler per TP rank). The rank and the real TP size are carried for identity,
  listener set-up and metrics, but no page operation ever leaves the process.
- :class:`~kvshare.runtime.coordinated.CoordinatedOwnership` — one owner decides and every
  rank maps the same page ids on its own device (vLLM: one scheduler drives all workers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.errors import PeerError, PoolError
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pages import PageMapper, PageSpace

__all__ = ["LocalOwnership", "Ownership"]


def check_rank(rank: int, world_size: int) -> None:
    """Raise :class:`PoolError` unless ``0 <= rank < world_size``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise PoolError(
            f"tensor-parallel rank {rank} of {world_size} is not valid: "
            "need world_size >= 1 and 0 <= rank < world_size"
        )


class Ownership(ABC):
    """How a pool's page operations reach the memory of a tensor-parallel group."""

    mode: ClassVar[str]
    rank: int | None
    """This process's tensor-parallel rank; ``None`` for an owner that is none of the ranks."""
    world_size: int
    """The real tensor-parallel size (identity, listener set-up, metrics)."""

    @abstractmethod
    def open_mapper(
        self,
        geometry: KVGeometry,
        backend: Backend | None,
        on_failure: Callable[[PeerError], None],
    ) -> PageMapper:
        """The mapper a pool drives. ``on_failure`` is called (from any thread) when a peer
        fails outside a page operation, so the pool can refuse further work at once."""


class LocalOwnership(Ownership):
    """Each rank owns its pages; page operations stay in this process."""

    mode = "local"

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        check_rank(rank, world_size)
        self.rank = rank
        self.world_size = world_size

    def open_mapper(
        self,
        geometry: KVGeometry,
        backend: Backend | None,
        on_failure: Callable[[PeerError], None],
    ) -> PageMapper:
        del on_failure  # nothing remote can fail
        if backend is None:
            raise PoolError("a pool with local ownership needs a backend: its pages are its own")
        return PageSpace(geometry, backend)

    def __repr__(self) -> str:
        return f"LocalOwnership(rank={self.rank}, world_size={self.world_size})"
