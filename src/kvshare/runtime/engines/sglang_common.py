"""SGLang hooks shared by every supported SGLang line. The line modules say where they apply.

SGLang runs one scheduler per tensor-parallel rank, each driving its own KV pool, so every
rank opens its own :class:`~kvshare.runtime.pool.KVPool` with *local* ownership: page
operations never leave the rank, while the real rank and TP size still reach the lease
(identity, metrics). What changes in SGLang:

- **Capacity** (``KVCacheConfigurator._profile_available_bytes``): the pool's virtual size
  instead of the device's free memory.
- **Start-up turn** (``Scheduler.init_model_worker`` to ``_create_buffers_normal``): the
  rank holds its GPU's turn from before it loads the model's weights until its KV buffers
  exist in the pool, so engines starting on one GPU never load into memory the broker has
  lent out, and the turn's reservation passes to the pool.
- **Tensors** (``MHATokenToKVPool._create_buffers_normal``): K and V of every layer are
  adjacent buffers of the pool's reserved range, shaped as SGLang shapes them (one pool
  block is one SGLang page; slot 0's page is the pool's reserved block 0): pages are
  per-layer, said once in the log and reported. Quantized buffers are refused: they would
  bypass the pool. So is SGLang's own VMM arena (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``,
  ``kv_vmm_backing.KvVmmArena``), a second reservation for the same KV cache: the rank's
  start-up refuses the setting before it loads anything, and the arena's buffers are
  never allocated.
- **Slots** (both token allocators): pages come from the pool for each allocation and go
  back to it when freed, with no device wait on that path (:mod:`.sglang_slots`).
- **Eviction** (``RadixCache.__init__`` and ``Scheduler.ingest_requests``): the radix
  cache is the pool's evictor. The pool asks from its own thread; the request is carried
  out by the scheduler at the start of its next loop iteration (idle or not), where
  SGLang's radix tree is consistent.
- **Fence** (``Scheduler.run_batch``): once a batch is launched the rank marks its pool's
  device fence on the streams it runs on (the forward stream of the overlap scheduler);
  SGLang frees a finished request's slots after launching the next batch, which may still
  read them, and the pool unmaps a freed page only once that work is done
  (:mod:`kvshare.runtime.fence`).
- **Ranks in step**: ranks must take identical allocation decisions, but each has its own
  GPU's lease. At that same point of every iteration the TP group agrees (one small
  all-reduce on SGLang's CPU group) on the smallest rank lease and the largest eviction
  asked for, and every rank applies both (:mod:`.group_lease`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from math import prod
from typing import TYPE_CHECKING, Any, cast

from kvshare.api import env
from kvshare.runtime.engines import pools
from kvshare.runtime.engines.group_lease import AgreedLease
from kvshare.runtime.engines.patching import AnyCallable, Patch, PatchSet, Target
from kvshare.runtime.engines.pools import EngineConfigError, Role
from kvshare.runtime.engines.sglang_slots import (
    attach_pool,
    clearing_into_pool,
    counting_the_pool,
    decode_pages,
    extend_pages,
    granting,
    hand_back,
    only_served_allocators,
    pool_of,
    returning_to_pool,
    token_pages,
)
from kvshare.runtime.paging import Paging

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)

__all__ = ["RadixEvictor", "pool_of", "sglang_patch_set"]

ENGINE = "sglang"
_EVICTOR_ATTRIBUTE = "_kvshare_evictor"


def _rank_role() -> Role:
    from sglang.srt.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    else:
        rank, world_size = 0, 1
    return Role(ENGINE, int(rank), int(world_size), "local")


def _tp_cpu_group() -> Any:
    from sglang.srt.distributed import parallel_state

    return parallel_state.get_tp_group().cpu_group


# --- tensors --------------------------------------------------------------------------


def buffers_from_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``MHATokenToKVPool._create_buffers_normal``: K/V over the pool."""

    def _create_buffers_normal(self: Any) -> None:
        from kvshare.runtime.geometry import KVGeometry

        if type(self).__name__ != "MHATokenToKVPool":
            raise EngineConfigError(
                f"kvshare serves SGLang's MHATokenToKVPool, not {type(self).__name__}, "
                "whose buffers are laid out differently"
            )
        if self.kv_cache_layout not in ("nhd", "hnd"):
            raise EngineConfigError(
                f"kvshare pages SGLang's nhd and hnd KV layouts, not {self.kv_cache_layout!r}"
            )
        paging = Paging("per-layer", "engine", "SGLang's MHATokenToKVPool keeps K and V per layer")
        if env.LAYOUT.require() == "block-outer":
            raise EngineConfigError(
                f"KVSHARE_LAYOUT=block-outer, but SGLang cannot give block-outer pages: "
                f"{paging.describe()}; use KVSHARE_LAYOUT=auto"
            )
        k_shape, v_shape = self._kv_buffer_shapes()
        if k_shape != v_shape:
            raise EngineConfigError(
                f"kvshare needs K and V rows of one shape; this model has K {k_shape} and "
                f"V {v_shape}"
            )
        rows = k_shape[0]
        rows_per_block = 1 if self.kv_cache_layout == "hnd" else self.page_size
        num_blocks = -(-rows // rows_per_block)
        block_bytes = rows_per_block * prod(k_shape[1:]) * self.store_dtype.itemsize
        geometry = KVGeometry(
            num_buffers=2 * self.layer_num,
            block_bytes=block_bytes,
            num_blocks=num_blocks,
            page_size=pools.page_size(),
            layout="per-layer",
        )
        role = _rank_role()
        pool = pools.open_local_pool(
            geometry, self.device, role, agreed=role.world_size > 1, paging=paging
        )
        log.info("kvshare: %s", paging.describe())
        shape = (num_blocks * rows_per_block, *k_shape[1:])

        def view(buffer: int) -> torch.Tensor:
            return pool.tensor(buffer)[0].view(self.store_dtype).view(shape)[:rows]

        self.k_buffer = [view(2 * layer) for layer in range(self.layer_num)]
        self.v_buffer = [view(2 * layer + 1) for layer in range(self.layer_num)]
        attach_pool(self, pool)
        pools.end_startup_turn()  # the pool holds what the turn reserved

    return _create_buffers_normal


def refusing(what: str) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for a buffer path that would bypass the pool: fail start-up, naming it."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise EngineConfigError(
                f"kvshare does not serve SGLang's {what}; start without it or unset KVSHARE_ENABLE"
            )

        return refuse

    return wrap


#: SGLang's switch for its own VMM arena (``kv_vmm_backing.KvVmmArena``).
VMM_ARENA_VARIABLE = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
_VMM_ARENA_REFUSAL = (
    f"{VMM_ARENA_VARIABLE} makes SGLang reserve its KV cache in a virtual-memory arena of its "
    "own (kv_vmm_backing.KvVmmArena) and size it after CUDA-graph capture; with kvshare the "
    f"pool is the KV allocation and one KV cache gets one reservation: set "
    f"{VMM_ARENA_VARIABLE}=0 (or unset KVSHARE_ENABLE to run without kvshare)"
)


def refuse_vmm_arena() -> None:
    """Fail start-up when SGLang's own setting asks for its VMM arena."""
    from sglang.srt.environ import envs

    if envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.get():
        raise EngineConfigError(_VMM_ARENA_REFUSAL)


def refusing_vmm_arena(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``MHATokenToKVPool._alloc_post_capture_buffers``: the arena is never
    reserved, whatever asked for it (the setting, or a model's own defaults)."""

    def _alloc_post_capture_buffers(self: Any) -> None:
        raise EngineConfigError(_VMM_ARENA_REFUSAL)

    return _alloc_post_capture_buffers


# --- eviction -------------------------------------------------------------------------


class RadixEvictor:
    """SGLang's radix cache as the pool's evictor (:class:`kvshare.runtime.pool.Evictor`).

    The pool calls :meth:`evict` from its own thread; the scheduler runs :meth:`step` at
    the start of each loop iteration, where the ranks of a TP group also agree on their
    lease (``group`` is SGLang's TP CPU group, ``None`` for a single rank).
    """

    def __init__(
        self,
        tree_cache: Any,
        page_size: int,
        evict_params: Callable[[int], Any],
        group: Any = None,
        lease: AgreedLease | None = None,
    ) -> None:
        self._tree_cache = tree_cache
        self._page_size = page_size
        self._evict_params = evict_params
        self._group = group
        self._lease = lease
        self._lock = threading.Lock()  # guards _pending
        self._pending = 0

    def cached_blocks(self) -> int:
        return int(self._tree_cache.evictable_size()) // self._page_size

    def evict(self, n: int) -> int:
        """Record the request; the scheduler frees the blocks on its next step."""
        with self._lock:
            self._pending = max(self._pending, n)
        return 0

    def step(self) -> int:
        """Agree with the group, then evict what any rank's pool asked for; pages freed."""
        with self._lock:
            blocks, self._pending = self._pending, 0
        if self._group is not None and self._lease is not None:
            blocks = self._agree(blocks)
        if blocks <= 0:
            return 0
        before = int(self._tree_cache.evictable_size())
        self._tree_cache.evict(self._evict_params(blocks * self._page_size))
        freed = (before - int(self._tree_cache.evictable_size())) // self._page_size
        log.info("evicted %d cached pages for the pool (asked %d)", freed, blocks)
        return freed

    def _agree(self, blocks: int) -> int:
        import torch
        import torch.distributed as dist

        assert self._lease is not None
        votes = torch.tensor([self._lease.own_limit(), -blocks], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self._group)
        self._lease.agree(int(votes[0]))
        return -int(votes[1])


def evicting_for_pool(evict_params: Callable[[int], Any]) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for ``RadixCache.__init__``: the cache becomes its pool's evictor."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def init(self: Any, params: Any) -> None:
            original(self, params)
            allocator = getattr(self, "token_to_kv_pool_allocator", None)
            pool = pool_of(allocator) if allocator is not None else None
            if pool is None:
                return
            lease = pool.lease if isinstance(pool.lease, AgreedLease) else None
            evictor = RadixEvictor(
                self, int(self.page_size), evict_params, _tp_cpu_group() if lease else None, lease
            )
            setattr(self, _EVICTOR_ATTRIBUTE, evictor)
            pool.set_evictor(evictor)

        return init

    return wrap


def evictor_of(tree_cache: Any) -> RadixEvictor | None:
    """The kvshare evictor of an SGLang prefix cache, if it has one."""
    return getattr(tree_cache, _EVICTOR_ATTRIBUTE, None)


def evicting_at_each_iteration(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.ingest_requests``: pending evictions run first."""

    def ingest_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        allocator = getattr(self, "token_to_kv_pool_allocator", None)
        pool = pool_of(allocator) if allocator is not None else None
        if pool is not None:
            hand_back(allocator, pool)  # freed pages whose copy is done, before it evicts
        evictor = evictor_of(getattr(self, "tree_cache", None))
        if evictor is not None:
            evictor.step()
        return original(self, *args, **kwargs)

    return ingest_requests


def marking_the_device_fence(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.run_batch``: the launched batch marks the pool's device fence
    on the current stream and the overlap scheduler's forward stream."""

    def run_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        pool = pool_of(self.token_to_kv_pool_allocator)
        if pool is not None and pool.backend is not None:
            pools.mark_launched(pool.backend.device, (getattr(self, "forward_stream", None),))
        return result

    return run_batch


# --- capacity -------------------------------------------------------------------------


def sizing_from_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``KVCacheConfigurator._profile_available_bytes``: the pool's virtual size."""

    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
        import torch

        device = torch.device(self.device)
        if device.type == "cuda" and cast("int | None", device.index) is None:
            device = torch.device("cuda", self.gpu_id)
        return pools.virtual_kv_bytes(device)

    return _profile_available_bytes


#: The tensor-parallel rank and size of a scheduler (``Scheduler.init_model_worker`` runs
#: before SGLang's parallel state exists; each line keeps them somewhere else).
SchedulerRank = Callable[[Any], "tuple[int, int]"]


def taking_the_startup_turn(scheduler_rank: SchedulerRank) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for ``Scheduler.init_model_worker``: the rank's start-up turn is held from
    before the weights load; the KV buffers end it (:func:`buffers_from_pool`), and a
    start-up that fails or builds none gives it back on the way out."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def init_model_worker(self: Any) -> None:
            refuse_vmm_arena()  # before the turn and the weights: nothing to undo
            rank, world_size = scheduler_rank(self)
            # An engine's ranks are children of one launcher process: its pid names the group.
            group = f"{ENGINE}-{os.getppid()}"
            pools.begin_startup_turn(Role(ENGINE, rank, world_size, "local"), group)
            try:
                original(self)
            finally:
                pools.end_startup_turn()

        return init_model_worker

    return wrap


# --- the patch list -------------------------------------------------------------------

_MEM = "sglang.srt.mem_cache"
_POOL = f"{_MEM}.memory_pool"
_TOKEN = f"{_MEM}.allocator.token"
_PAGED = f"{_MEM}.allocator.paged"


def evict_tokens(num_tokens: int) -> Any:
    """SGLang's eviction request for ``num_tokens`` tokens."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=num_tokens)


def sglang_patch_set(
    line: str, *, ingest_parameters: tuple[str, ...], scheduler_rank: SchedulerRank
) -> PatchSet:
    """The patches of one SGLang line; the lines differ in the scheduler's loop entry and in
    where a scheduler's tensor-parallel rank is kept."""
    self_only = ("self",)
    patches = [
        Patch(
            Target("sglang.srt.managers.scheduler", "Scheduler.init_model_worker", self_only),
            taking_the_startup_turn(scheduler_rank),
            "the rank holds its GPU's start-up turn from its weights to its KV buffers",
        ),
        Patch(
            Target(
                f"{_MEM}.kv_cache_configurator",
                "KVCacheConfigurator._profile_available_bytes",
                ("self", "pre_model_load_memory"),
            ),
            sizing_from_pool,
            "KV capacity from the pool's virtual size, not free memory",
        ),
        Patch(
            Target(_POOL, "MHATokenToKVPool._create_buffers_normal", self_only),
            buffers_from_pool,
            "K and V buffers over the pool's reserved range",
        ),
        Patch(
            Target(_POOL, "MHATokenToKVPool._create_quantized_buffers", self_only),
            refusing("quantized KV cache"),
            "refused: would bypass the pool",
        ),
        Patch(
            Target(_POOL, "MHATokenToKVPool._alloc_post_capture_buffers", self_only),
            refusing_vmm_arena,
            "refused: would bypass the pool",
        ),
    ]
    for module, cls in (
        (_TOKEN, "TokenToKVPoolAllocator"),
        (_PAGED, "PagedTokenToKVPoolAllocator"),
    ):
        patches += [
            Patch(
                Target(module, f"{cls}.clear", self_only),
                clearing_into_pool,
                "pages back to the pool",
            ),
            Patch(
                Target(module, f"{cls}.available_size", self_only),
                counting_the_pool,
                "free = what the pool grants",
            ),
            Patch(
                Target(module, f"{cls}.alloc", ("self", "need_size")),
                granting(token_pages),
                "slots from the pool",
            ),
        ]
    patches += [
        Patch(
            Target(
                f"{_MEM}.allocator.base",
                "BaseTokenToKVPoolAllocator.__init__",
                ("self", "size", "page_size", "dtype", "device", "kvcache", "need_sort"),
            ),
            only_served_allocators,
            "refused: allocators that would hand out slots of unmapped pages",
        ),
        Patch(
            Target(_TOKEN, "TokenToKVPoolAllocator.free", ("self", "free_index")),
            returning_to_pool,
            "freed slots back to the pool",
        ),
        Patch(
            Target(
                _PAGED,
                "PagedTokenToKVPoolAllocator.alloc_extend",
                (
                    "self",
                    "prefix_lens",
                    "prefix_lens_cpu",
                    "seq_lens",
                    "seq_lens_cpu",
                    "last_loc",
                    "extend_num_tokens",
                    "num_new_pages",
                ),
            ),
            granting(extend_pages),
            "pages from the pool",
        ),
        Patch(
            Target(
                _PAGED,
                "PagedTokenToKVPoolAllocator.alloc_decode",
                ("self", "seq_lens", "seq_lens_cpu", "last_loc"),
            ),
            granting(decode_pages),
            "pages from the pool",
        ),
        Patch(
            Target(_PAGED, "PagedTokenToKVPoolAllocator._release_page_ids", ("self", "page_ids")),
            returning_to_pool,
            "freed pages back to the pool",
        ),
        Patch(
            Target(f"{_MEM}.radix_cache", "RadixCache.__init__", ("self", "params")),
            evicting_for_pool(evict_tokens),
            "the radix cache is the pool's evictor",
        ),
        Patch(
            Target("sglang.srt.managers.scheduler", "Scheduler.ingest_requests", ingest_parameters),
            evicting_at_each_iteration,
            "ranks agree on their lease and evict at each iteration",
        ),
        Patch(
            Target(
                "sglang.srt.managers.scheduler",
                "Scheduler.run_batch",
                ("self", "batch", "pp_proxy_tensors"),
            ),
            marking_the_device_fence,
            "a launched batch marks the rank's device fence: no unmap before it is done",
        ),
    ]
    requires = [
        Target(_POOL, "MHATokenToKVPool._kv_buffer_shapes", self_only),
        Target(f"{_MEM}.radix_cache", "RadixCache.evict", ("self", "params")),
        Target(f"{_MEM}.radix_cache", "RadixCache.evictable_size", self_only),
        Target(
            f"{_MEM}.base_prefix_cache",
            "EvictParams.__init__",
            ("self", "num_tokens", "swa_num_tokens", "mamba_num"),
        ),
        Target(
            "sglang.srt.utils",
            "get_num_new_pages",
            ("seq_lens", "page_size", "prefix_lens", "decode"),
        ),
        Target("sglang.srt.distributed.parallel_state", "get_tensor_model_parallel_rank", ()),
        Target("sglang.srt.distributed.parallel_state", "get_tensor_model_parallel_world_size", ()),
        Target("sglang.srt.distributed.parallel_state", "get_tp_group", ()),
    ]
    return PatchSet(ENGINE, line, patches, requires)
