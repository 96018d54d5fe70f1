"""vLLM hooks shared by every supported vLLM line. The line modules say where they apply.

What changes in vLLM:

- **Capacity** (``Worker.determine_available_memory``): the engine sizes its KV cache
  from the pool's virtual size, by setting vLLM's own ``kv_cache_memory_bytes`` before
  its profiling runs (the profile run still compiles the model). The device's free
  memory no longer matters.
- **Start-up turn** (``Worker.init_device`` to ``Worker.initialize_from_config``): each
  worker holds its GPU's turn from the broker while vLLM checks free memory, loads
  weights, profiles and allocates its KV cache, so engines starting on one GPU do not
  measure each other.
- **Tensors** (``allocate_kv_cache`` where the model runners call it): one
  :class:`~kvshare.runtime.pool.KVPool` per worker, on the worker's own device, whose
  geometry mirrors vLLM's layout: layer-outer layouts get one pool buffer per layer,
  block-outer layouts one buffer of packed blocks. vLLM's own
  ``create_kv_cache_views`` builds the per-layer views over the pool's range.
- **Blocks** (``KVCacheCoordinator.__init__``): the scheduler's ``BlockPool`` keeps every
  piece of its logic, but its free queue becomes a :class:`PooledFreeBlockQueue`:
  fresh blocks come from ``KVPool.alloc``, blocks freed without a prefix-cache hash go
  back to the pool at once, and cached blocks stay in vLLM's LRU queue until vLLM reuses
  them or the pool asks for memory back (:class:`BlockPoolEvictor`). The free count the
  scheduler checks is what the pool can hand out now plus the cached blocks, so
  exhaustion makes ``allocate_slots`` return ``None`` and the scheduler preempts or waits.
- **Consistency**: one re-entrant lock per block pool, held by the queue, by the
  evictor (which runs on the pool's thread) and around ``Scheduler.schedule`` and
  ``Scheduler.update_from_output``, so a prefix hit found in ``schedule`` is never evicted
  before ``schedule`` takes a reference to it.

Tensor parallelism uses *coordinated* ownership: each worker serves its device's memory
through a rank server (``Worker.initialize_from_config`` names the group after vLLM's
instance id and data-parallel rank), and the scheduler's pool, which holds no memory
itself, maps every page on all ranks before it hands out a block (``Scheduler.__init__``
names the same group). With one worker in the scheduler's process the group has one rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.patching import AnyCallable, Patch, PatchSet, Target
from kvshare.runtime.engines.pools import EngineConfigError, Role

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.pool import KVPool

log = logging.getLogger(__name__)

__all__ = [
    "BlockPoolEvictor",
    "PoolPlan",
    "PooledFreeBlockQueue",
    "plan_pool",
    "vllm_patch_set",
]

ENGINE = "vllm"
#: Picks the kernel block size of one tensor's views, as the line's ``allocate_kv_cache`` does.
KernelBlockSize = Callable[[Any, int, "list[int] | None"], "int | None"]


# --- geometry ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The pool geometry for a vLLM KV cache config, and its tensors placed in that pool."""

    geometry: KVGeometry
    tensors: tuple[Any, ...]
    """vLLM ``KVCacheTensor``s with offsets and layer strides in the pool's range."""


def plan_pool(kv_cache_config: Any, layout: Any) -> PoolPlan:
    """Mirror vLLM's layout in a pool geometry (the scheduler and workers agree on it).

    Layer-outer layouts (``L`` then ``B`` outermost) keep each layer's blocks in one run:
    one pool buffer per layer, the layer stride becomes the pool's page-aligned buffer
    stride. Block-outer layouts keep all layers of a block in one packed run: one pool
    buffer of packed blocks, nothing moves. Other layouts split a block across a
    layer's region and are refused.
    """
    from kvshare.runtime.geometry import KVGeometry

    tensors = tuple(kv_cache_config.kv_cache_tensors)
    num_blocks = kv_cache_config.num_blocks
    strides = {tensor.block_stride for tensor in tensors}
    sizes = {tensor.size for tensor in tensors}
    if len(strides) != 1 or len(sizes) != 1:
        raise EngineConfigError(
            "kvshare needs one block stride and one backing allocation for every KV cache "
            f"tensor; this model has block strides {sorted(strides)} (hybrid page sizes)"
        )
    block_stride, raw_size = strides.pop(), sizes.pop()
    if layout.is_block_outermost:
        geometry = KVGeometry(1, block_stride, num_blocks, pools.page_size(), "per-layer")
        return PoolPlan(geometry, tensors)
    if not layout.is_block_compact:
        raise EngineConfigError(
            f"kvshare cannot page vLLM's KV cache layout {layout.name}: a block is not one "
            "contiguous run per layer; set VLLM_KV_CACHE_LAYOUT to a layer- or block-outer "
            "layout (e.g. LBHNC or BLHNC)"
        )
    layer_bytes = block_stride * num_blocks
    if raw_size % layer_bytes or any(tensor.offset % layer_bytes for tensor in tensors):
        raise EngineConfigError(
            f"vLLM's KV cache tensors are not whole layers of {layer_bytes} bytes; "
            "kvshare cannot page this layout"
        )
    geometry = KVGeometry(
        raw_size // layer_bytes, block_stride, num_blocks, pools.page_size(), "per-layer"
    )
    placed = tuple(
        dataclasses.replace(
            tensor,
            size=geometry.virtual_bytes,
            offset=tensor.offset // layer_bytes * geometry.buffer_stride,
            layer_stride=geometry.buffer_stride,
        )
        for tensor in tensors
    )
    return PoolPlan(geometry, placed)


@dataclasses.dataclass(frozen=True)
class Group:
    """A coordinated group: one vLLM engine core and its tensor-parallel workers."""

    name: str
    world_size: int


#: Set while vLLM builds a worker's KV cache (``Worker.initialize_from_config``).
_worker: contextvars.ContextVar[tuple[Group, Role]] = contextvars.ContextVar("kvshare_vllm_worker")
#: Set while vLLM builds its scheduler (``Scheduler.__init__``): the group and KV layout.
_scheduler: contextvars.ContextVar[tuple[Group, Any]] = contextvars.ContextVar(
    "kvshare_vllm_scheduler"
)


def group_of(vllm_config: Any) -> Group:
    """The group of one engine core: named after vLLM's instance id and data-parallel rank."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise EngineConfigError(
            f"kvshare serves vLLM with pipeline-parallel size 1, not "
            f"{parallel.pipeline_parallel_size}"
        )
    instance = re.sub(r"[^A-Za-z0-9._-]", "-", str(vllm_config.instance_id))[:32] or "engine"
    name = f"vllm-{instance}-dp{parallel.data_parallel_rank}"
    return Group(name, int(parallel.tensor_parallel_size))


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


@contextlib.contextmanager
def worker_context(group: Group, rank: int) -> Iterator[None]:
    """While set, ``allocate_kv_cache`` serves rank ``rank`` of ``group``."""
    token = _worker.set((group, Role(ENGINE, rank, group.world_size, "coordinated")))
    try:
        yield
    finally:
        _worker.reset(token)


@contextlib.contextmanager
def scheduler_context(group: Group, layout: Any) -> Iterator[None]:
    """While set, a KV cache coordinator draws its blocks from ``group``'s owner pool."""
    token = _scheduler.set((group, layout))
    try:
        yield
    finally:
        _scheduler.reset(token)


_TURN_ATTRIBUTE = "_kvshare_startup_turn"


def taking_the_startup_turn(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.init_device``: the GPU's start-up turn is held from here (vLLM
    checks free memory first, then loads weights and profiles) until the KV cache exists."""

    def init_device(self: Any) -> None:
        group = group_of(self.vllm_config)
        turn = contextlib.ExitStack()
        turn.enter_context(
            pools.startup_turn(Role(ENGINE, int(self.local_rank), group.world_size, "coordinated"))
        )
        setattr(self, _TURN_ATTRIBUTE, turn)
        try:
            original(self)
        except BaseException:
            turn.close()
            raise

    return init_device


def in_worker_group(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.initialize_from_config``: the worker's KV cache joins its group;
    the start-up turn ends once it exists."""

    def initialize_from_config(self: Any, kv_cache_config: Any) -> None:
        try:
            with worker_context(group_of(self.vllm_config), _tp_rank()):
                original(self, kv_cache_config)
        finally:
            turn = getattr(self, _TURN_ATTRIBUTE, None)
            if turn is not None:
                setattr(self, _TURN_ATTRIBUTE, None)
                turn.close()

    return initialize_from_config


def in_scheduler_group(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.__init__``: its block pool becomes the group's owner."""

    def init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        with scheduler_context(group_of(vllm_config), layout):
            original(self, vllm_config, *args, **kwargs)

    return init


# --- worker: KV cache tensors ---------------------------------------------------------


def group_kernel_block_size(
    spec: Any, group_id: int, kernel_block_sizes: list[int] | None
) -> int | None:
    """The kernel block size of a group's views, when the model runner chose one."""
    del spec
    if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
        return kernel_block_sizes[group_id]
    return None


def allocating_from_pool(
    kernel_block_size: KernelBlockSize,
) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for ``allocate_kv_cache``: the same views, over the pool's range."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def allocate_kv_cache(
            kv_cache_config: Any,
            device: torch.device,
            layout: Any,
            kernel_block_sizes: list[int] | None = None,
        ) -> dict[str, torch.Tensor]:
            if not kv_cache_config.kv_cache_tensors:
                return original(kv_cache_config, device, layout, kernel_block_sizes)  # type: ignore[no-any-return]
            context = _worker.get(None)
            if context is None:
                raise EngineConfigError(
                    "vLLM allocated a KV cache outside a worker's initialize_from_config; "
                    "kvshare cannot tell which engine it belongs to"
                )
            group, role = context
            plan = plan_pool(kv_cache_config, layout)
            server = pools.open_rank(plan.geometry, device, role, group.name)
            raw = server.tensor(0, plan.geometry.num_buffers).view(_int8())
            return _views(
                raw,
                kv_cache_config,
                plan,
                layout=layout,
                kernel_block_sizes=kernel_block_sizes,
                kernel_block_size=kernel_block_size,
            )

        return allocate_kv_cache

    return wrap


def _int8() -> torch.dtype:
    import torch

    return torch.int8


def _views(
    raw: torch.Tensor,
    kv_cache_config: Any,
    plan: PoolPlan,
    *,
    layout: Any,
    kernel_block_sizes: list[int] | None,
    kernel_block_size: KernelBlockSize,
) -> dict[str, torch.Tensor]:
    """Per-layer views built by vLLM's ``create_kv_cache_views``, as vLLM lays them out."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in plan.tensors:
        layer_name = tensor.layers[0]
        group_id, group = next(
            (group_id, group)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
            if layer_name in group.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        if not spec.has_layer_views:
            raise EngineConfigError(
                f"layer {layer_name} keeps {type(spec).__name__} state that lays out its own "
                "storage; kvshare pages attention KV caches only"
            )
        views = create_kv_cache_views(
            raw,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size(spec, group_id, kernel_block_sizes),
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches


# --- worker: capacity -----------------------------------------------------------------


def sizing_from_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.determine_available_memory``: the pool's virtual size."""

    def determine_available_memory(self: Any) -> int:
        # vLLM's own "KV cache of this many bytes" setting: its profiling still runs (and
        # compiles the model) but no longer derives the size from free memory.
        self.cache_config.kv_cache_memory_bytes = pools.virtual_kv_bytes(self.device)
        return original(self)  # type: ignore[no-any-return]

    return determine_available_memory


# --- scheduler: blocks ------------------------------------------------------------------


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
                raise ValueError(f"Cannot get {n} free blocks from the pool")
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


def attaching_block_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``KVCacheCoordinator.__init__``: its block pool draws from the group."""

    def init(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, kv_cache_config, *args, **kwargs)
        if not kv_cache_config.kv_cache_tensors:
            return  # an attention-free model: no KV cache to page
        context = _scheduler.get(None)
        if context is None:
            raise EngineConfigError(
                "vLLM built a KV cache coordinator outside its scheduler; kvshare cannot tell "
                "which engine's workers hold the memory"
            )
        group, layout = context
        plan = plan_pool(kv_cache_config, layout)
        attach(self.block_pool, pools.open_owner_pool(plan.geometry, group.name, group.world_size))

    return init


def holding_block_pool_lock(original: AnyCallable) -> AnyCallable:
    """Wrapper for a scheduler step: the pool's evictor waits until it is over."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        queue = queue_of(self.kv_cache_manager.block_pool)
        if queue is None:
            return original(self, *args, **kwargs)
        with queue.lock:
            return original(self, *args, **kwargs)

    return step


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


# --- the patch list -------------------------------------------------------------------

_WORKER = "vllm.v1.worker"
_CORE = "vllm.v1.core"
_ALLOCATE = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
_SCHEDULER_INIT = (
    "self",
    "vllm_config",
    "kv_cache_config",
    "structured_output_manager",
    "block_size",
    "hash_block_size",
    "mm_registry",
    "include_finished_set",
    "log_stats",
)


def vllm_patch_set(
    line: str,
    *,
    coordinator_parameters: tuple[str, ...],
    block_pool_parameters: tuple[str, ...],
    kernel_block_size: KernelBlockSize,
) -> PatchSet:
    """The patches of one vLLM line. The lines keep the targets in the same places; they
    differ in constructor parameters and in how a tensor's kernel block size is chosen."""
    block_pool = f"{_CORE}.block_pool"
    scheduler = f"{_CORE}.sched.scheduler"
    patches = [
        Patch(
            Target(f"{_WORKER}.gpu_worker", "Worker.init_device", ("self",)),
            taking_the_startup_turn,
            "the worker holds its GPU's start-up turn until its KV cache exists",
        ),
        Patch(
            Target(f"{_WORKER}.gpu_worker", "Worker.determine_available_memory", ("self",)),
            sizing_from_pool,
            "KV capacity from the pool's virtual size, not free memory",
        ),
        *(
            Patch(
                Target(module, "allocate_kv_cache", _ALLOCATE),
                allocating_from_pool(kernel_block_size),
                "KV cache tensors over the pool's reserved range",
            )
            for module in (f"{_WORKER}.gpu_model_runner", f"{_WORKER}.gpu.attn_utils")
        ),
        Patch(
            Target(
                f"{_WORKER}.gpu_worker",
                "Worker.initialize_from_config",
                ("self", "kv_cache_config"),
            ),
            in_worker_group,
            "the worker's KV cache is a rank of its engine's coordinated group; turn ends",
        ),
        Patch(
            Target(f"{_CORE}.sched.scheduler", "Scheduler.__init__", _SCHEDULER_INIT),
            in_scheduler_group,
            "the scheduler's block pool owns its engine's coordinated group",
        ),
        Patch(
            Target(
                f"{_CORE}.kv_cache_coordinator",
                "KVCacheCoordinator.__init__",
                coordinator_parameters,
            ),
            attaching_block_pool,
            "the scheduler's block ids come from the pool",
        ),
        *(
            Patch(
                Target(scheduler, f"Scheduler.{name}", parameters),
                holding_block_pool_lock,
                "the pool evicts cached blocks between scheduler steps",
            )
            for name, parameters in (
                ("schedule", ("self", "throttle_prefills")),
                ("update_from_output", ("self", "scheduler_output", "model_runner_output")),
            )
        ),
        Patch(
            Target(block_pool, "BlockPool.reset_prefix_cache", ("self",)),
            resetting_through_pool,
            "a prefix-cache reset gives the cached blocks back to the pool",
        ),
        Patch(
            Target(block_pool, "BlockPool.get_usage", ("self",)),
            usage_of_held_memory,
            "KV usage relative to what the pool can hold now",
        ),
    ]
    requires = [
        Target(block_pool, "BlockPool.__init__", block_pool_parameters),
        Target(block_pool, "BlockPool.get_new_blocks", ("self", "num_blocks")),
        Target(block_pool, "BlockPool.free_blocks", ("self", "ordered_blocks")),
        Target(block_pool, "BlockPool.touch", ("self", "blocks")),
        Target(block_pool, "BlockPool._maybe_evict_cached_block", ("self", "block")),
        Target(block_pool, "BlockPool._notify_reuse", ("self", "blocks")),
        Target(f"{_CORE}.kv_cache_utils", "FreeKVCacheBlockQueue.__init__", ("self", "blocks")),
        Target(
            "vllm.v1.kv_cache_interface",
            "create_kv_cache_views",
            ("raw", "spec", "num_blocks", "layout", "kv_cache_tensor", "kernel_block_size"),
        ),
    ]
    return PatchSet(ENGINE, line, patches, requires)
