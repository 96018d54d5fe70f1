"""vLLM's scheduler-side block pool, backed by a kvshare pool (shared by every vLLM line).

vLLM's ``BlockPool`` keeps every piece of its logic; only its free queue changes
(:class:`PooledFreeBlockQueue`). Fresh blocks come from ``KVPool.alloc``, blocks freed
without a prefix-cache hash go back to the pool at once, and cached blocks stay in vLLM's
LRU queue until vLLM reuses them or the pool asks for memory back
(:class:`BlockPoolEvictor`). The free count the scheduler checks is what the pool can hand
out now plus the cached blocks, so exhaustion makes ``allocate_slots`` return ``None`` and
the scheduler preempts or waits.

Threads: the evictor runs on the pool's thread. One re-entrant lock per block pool
(``PooledFreeBlockQueue.lock``) is held by every queue operation, by the evictor and around
``Scheduler.schedule`` and ``Scheduler.update_from_output`` (see
:func:`scheduling_a_step`), so a prefix hit found in ``schedule`` is never evicted before
``schedule`` takes a reference to it. The same steps hold the pool's lease steady, so a
reclaim never lands between vLLM counting free blocks and taking them, and count the
pool's step fence: with asynchronous scheduling a block freed by one step's output may
still be read by the next step, already on the GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvshare.runtime.engines.patching import AnyCallable
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.pool import Exhausted

if TYPE_CHECKING:
    from kvshare.runtime.pool import KVPool

log = logging.getLogger(__name__)

__all__ = [
    "BlockPoolEvictor",
    "PooledFreeBlockQueue",
    "attach",
    "finishing_a_step",
    "queue_of",
    "resetting_through_pool",
    "scheduling_a_step",
    "signalling_shortfall",
    "usage_of_held_memory",
]


class PooledFreeBlockQueue:
    """vLLM's free block queue, backed by a kvshare pool.

    Holds, in vLLM's own LRU queue, only the blocks vLLM keeps at reference count 0 for
    later (prefix-cached blocks, and blocks released with a reuse watcher); every other
    free block is free in the pool, where its page can be unmapped. ``num_free_blocks``
    is what the pool can hand out now plus the held blocks.
    """

    def __init__(self, block_pool: Any, pool: KVPool, held: Any) -> None:
        self.block_pool = block_pool
        self.pool = pool
        self.held = held
        self.lock = threading.RLock()  # guards held and the block pool's cache state
        self._all_free_for_reset = False

    @property
    def num_free_blocks(self) -> int:
        if self._all_free_for_reset:
            return int(self.block_pool.num_gpu_blocks) - 1
        return int(self.held.num_free_blocks) + self.pool.available()

    @property
    def num_held_blocks(self) -> int:
        """Blocks at reference count 0 that vLLM keeps (cached or watched)."""
        return int(self.held.num_free_blocks)

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        """``n`` blocks: fresh ones from the pool first, then vLLM's least recently used."""
        if n == 0:
            return []
        with self.lock:
            fresh = min(n, self.pool.available())
            granted = self.pool.alloc(fresh) if fresh else []
            ids = granted if isinstance(granted, list) else []  # Exhausted: none fresh
            blocks = [self.block_pool.blocks[i] for i in ids]
            short = n - len(blocks)
            if short > self.held.num_free_blocks:
                if ids:
                    self.pool.free(ids)
                why = f" ({granted.reason})" if isinstance(granted, Exhausted) else ""
                raise ValueError(f"Cannot get {n} free blocks from the pool{why}")
            if short:
                blocks.extend(self.held.popleft_n(short))
            return blocks

    def remove(self, block: Any) -> None:
        with self.lock:
            self.held.remove(block)

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        """Blocks to reuse last (cached or watched): vLLM keeps them, LRU order."""
        with self.lock:
            keep = [block for block in blocks if self._keeps(block)]
            self.held.append_n(keep)
            self._release([block for block in blocks if not self._keeps(block)])

    def prepend_n(self, blocks: list[Any]) -> None:
        """Blocks to reuse first (no hash): back to the pool, unless vLLM still reads them."""
        with self.lock:
            keep = [block for block in blocks if self._keeps(block)]
            self.held.prepend_n(keep)
            self._release([block for block in blocks if not self._keeps(block)])

    def get_all_free_blocks(self) -> list[Any]:
        """The held blocks (blocks free in the pool have no vLLM state worth listing)."""
        with self.lock:
            return list(self.held.get_all_free_blocks())

    def _keeps(self, block: Any) -> bool:
        return block.block_hash is not None or block.block_id in self.block_pool._reuse_watchers

    def _release(self, blocks: Sequence[Any]) -> None:
        if blocks:
            self.pool.free([block.block_id for block in blocks])

    def release_held(self, n: int) -> int:
        """Evict up to ``n`` held blocks from vLLM's cache and free them in the pool."""
        with self.lock:
            count = min(n, self.held.num_free_blocks)
            if count <= 0:
                return 0
            blocks = self.held.popleft_n(count)
            if self.block_pool._reuse_watchers:
                self.block_pool._notify_reuse(blocks)
            for block in blocks:
                self.block_pool._maybe_evict_cached_block(block)
            self.pool.free([block.block_id for block in blocks])
            return int(count)


class BlockPoolEvictor:
    """The pool's view of vLLM's prefix cache (:class:`kvshare.runtime.pool.Evictor`)."""

    def __init__(self, queue: PooledFreeBlockQueue) -> None:
        self._queue = queue

    def cached_blocks(self) -> int:
        return self._queue.num_held_blocks

    def evict(self, n: int) -> int:
        """Runs on the pool's thread; waits for the scheduler's current step to end."""
        return self._queue.release_held(n)


def queue_of(block_pool: Any) -> PooledFreeBlockQueue | None:
    """The kvshare queue of a vLLM block pool, if it has one."""
    queue = getattr(block_pool, "free_block_queue", None)
    return queue if isinstance(queue, PooledFreeBlockQueue) else None


def attach(block_pool: Any, pool: KVPool) -> PooledFreeBlockQueue:
    """Back ``block_pool`` by ``pool``: every block id vLLM uses comes from the pool."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    if pool.geometry.num_blocks != block_pool.num_gpu_blocks:
        raise EngineConfigError(
            f"vLLM's block pool has {block_pool.num_gpu_blocks} blocks but the kvshare pool "
            f"has {pool.geometry.num_blocks}; the scheduler and the worker disagree on the "
            "KV cache size"
        )
    if block_pool.null_block.block_id != 0:
        raise EngineConfigError("vLLM's null block is not block 0; kvshare reserves block 0")
    queue = PooledFreeBlockQueue(block_pool, pool, FreeKVCacheBlockQueue([]))
    block_pool.free_block_queue = queue
    pool.set_evictor(BlockPoolEvictor(queue))
    return queue


def _holding_block_pool_lock(original: AnyCallable, counted: str) -> AnyCallable:
    """A scheduler step that holds the block pool's lock and its lease steady, and counts
    the step on the pool's step fence (``counted``: ``"scheduled"`` or ``"finished"``)."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        queue = queue_of(self.kv_cache_manager.block_pool)
        if queue is None:
            return original(self, *args, **kwargs)
        getattr(queue.pool.steps, counted)()
        with queue.pool.steady_lease(), queue.lock:
            return original(self, *args, **kwargs)

    return step


def scheduling_a_step(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.schedule``: the pool's evictor waits until the step is over,
    and so does a lowered lease (vLLM counts free blocks and takes them later in the step,
    with no way to fail in between; see :meth:`KVPool.steady_lease`). The step counts as
    scheduled: pages emptied from now on wait for its output before they are unmapped."""
    return _holding_block_pool_lock(original, "scheduled")


def finishing_a_step(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.update_from_output``: as :func:`scheduling_a_step`, and the
    oldest step in flight counts as finished (its output is in hand)."""
    return _holding_block_pool_lock(original, "finished")


def resetting_through_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``BlockPool.reset_prefix_cache``: "all free" means no block in use."""

    def reset_prefix_cache(self: Any) -> bool:
        queue = queue_of(self)
        if queue is None:
            return original(self)  # type: ignore[no-any-return]
        with queue.lock:
            in_use = queue.pool.snapshot().used_blocks - queue.num_held_blocks
            if in_use:
                log.warning(
                    "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                    in_use,
                )
                return False
            queue._all_free_for_reset = True
            try:
                done = original(self)
            finally:
                queue._all_free_for_reset = False
            if done:
                queue.release_held(queue.num_held_blocks)
            return done  # type: ignore[no-any-return]

    return reset_prefix_cache


def signalling_shortfall(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``KVCacheManager.allocate_slots``: vLLM compares the blocks a request
    needs with the free count and returns ``None`` without asking the free queue; the pool
    then hears of the shortfall and asks for more lease, as an allocation it could not serve
    would (a pool reclaimed to its minimum would otherwise never grow again while vLLM only
    ever takes what it sees free)."""

    def allocate_slots(
        self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        blocks = original(self, request, num_new_tokens, *args, **kwargs)
        if blocks is None:
            queue = queue_of(self.block_pool)
            if queue is not None:
                tokens = int(self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
                queue.pool.short_of(-(-max(1, int(num_new_tokens)) // tokens) + 1)
        return blocks

    return allocate_slots


def usage_of_held_memory(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``BlockPool.get_usage``: blocks in use over blocks in use or free now."""

    def get_usage(self: Any) -> float:
        queue = queue_of(self)
        if queue is None:
            return original(self)  # type: ignore[no-any-return]
        in_use = queue.pool.snapshot().used_blocks - queue.num_held_blocks
        total = in_use + queue.num_free_blocks
        return in_use / total if total else 0.0

    return get_usage
