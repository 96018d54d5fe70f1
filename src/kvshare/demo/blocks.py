"""The simulated engine's side of KV blocks: the allocator it draws from, and its prefix
cache.

Threads: the engine is driven from one thread. The pool may call the prefix cache's
``evict`` from another thread (a lease reclaim); the cache guards its state with its own
lock and never calls the allocator while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["BlockAllocator", "ModelShare", "PrefixCache", "SharedBlocks"]


class BlockAllocator(Protocol):
    """The part of ``KVPool`` the engine uses (see :mod:`kvshare.runtime.pool`)."""

    def alloc(self, n: int, *, running: bool = False) -> object:
        """``n`` block ids as a ``list[int]``, or a falsy "no space" result. ``running``:
        they grow a running request (not one being admitted)."""

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back."""

    def expect_blocks(self, count: int) -> None:
        """The engine's running requests take at most ``count`` new blocks in its next
        step (said after each step)."""


class SharedBlocks(Protocol):
    """Blocks from one memory for several models, first come (the worlds without a
    broker: the pooled bound, first-come pages)."""

    def alloc(self, model: int, n: int) -> list[int] | None:
        """``n`` block ids for ``model``, or None (nothing taken) when they do not fit."""

    def free(self, model: int, ids: Iterable[int]) -> None:
        """Give ``model``'s blocks back."""


class ModelShare:
    """One model's side of :class:`SharedBlocks`: the :class:`BlockAllocator` its engine
    uses. Such a world has no lease, so there is nothing to keep pages for."""

    def __init__(self, blocks: SharedBlocks, model: int) -> None:
        self._blocks = blocks
        self._model = model

    def alloc(self, n: int, *, running: bool = False) -> list[int] | None:
        return self._blocks.alloc(self._model, n)

    def free(self, ids: Iterable[int]) -> None:
        self._blocks.free(self._model, ids)

    def expect_blocks(self, count: int) -> None:
        """Nothing to keep pages for: no lease."""


class PrefixCache:
    """One model's system-prompt blocks: shared by the requests using them, then cached.

    The blocks form one chain (block ``i`` holds tokens ``[i * B, (i + 1) * B)`` of the
    prefix). While any running request references the chain it is in use; otherwise it is
    cached and :meth:`evict` frees blocks from its tail.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self._allocator = allocator
        self._lock = threading.Lock()  # guards _chain and _refs; never held across allocator calls
        self._chain: list[int] = []
        self._refs = 0
        self.evicted_blocks = 0

    def acquire(self) -> int:
        """Reference the chain (so it cannot be evicted); returns its length in blocks."""
        with self._lock:
            self._refs += 1
            return len(self._chain)

    def extend(self, blocks: Sequence[int]) -> None:
        """Append freshly computed prefix blocks to the chain (caller holds a reference)."""
        with self._lock:
            self._chain.extend(blocks)

    def release(self) -> None:
        """Drop one reference; at zero the chain becomes evictable cache."""
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("prefix cache released more often than acquired")
            self._refs -= 1

    def in_use_blocks(self) -> int:
        """Chain blocks referenced by running requests."""
        with self._lock:
            return len(self._chain) if self._refs else 0

    def cached_blocks(self) -> int:
        """Blocks held only as cache: what :meth:`evict` could free now."""
        with self._lock:
            return 0 if self._refs else len(self._chain)

    def evict(self, n: int) -> int:
        """Free up to ``n`` unreferenced blocks from the chain's tail; returns how many."""
        with self._lock:
            if self._refs or n <= 0:
                return 0
            victims = self._chain[-n:]
            del self._chain[-n:]
            self.evicted_blocks += len(victims)
        if victims:
            self._allocator.free(victims)
        return len(victims)
