"""Patches for vLLM 0.34.x (see :mod:`kvshare.runtime.engines.vllm_common`).

The constructor parameters of 0.33.x. What 0.34 changed under them:

- The V1 model runner (``gpu_model_runner``) is gone: the GPU runner allocates its KV
  cache only in ``gpu.attn_utils``, whose ``allocate_kv_cache`` takes an ``allocate``
  hook (vLLM's extensible KV cache passes its own); the CPU runner moved to
  ``cpu.model_runner`` and allocates in ``cpu.attn_utils``.
- The extensible KV cache (``CacheConfig.enable_extensible_kv_cache``, on by default on
  CUDA and ROCm) reserves the KV range with CUDA virtual memory, commits what it measures
  free after warm-up and defaults ``gpu_memory_utilization`` to 1.0. With kvshare the
  pool is the KV allocation: the extensible cache is settled off before vLLM resolves
  anything from it (an explicit ``--enable-extensible-kv-cache`` is refused at start-up),
  so no second reservation exists and the start-up check asks for kvshare's grant.
- ``BlockPool.free_blocks`` takes ``evict_first`` (it still frees through the queue's
  ``prepend_n``/``append_n``, which kvshare's queue serves).
"""

from __future__ import annotations

from typing import Any

from kvshare.runtime.engines.patching import AnyCallable, Patch, Target
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.engines.vllm_common import (
    ALLOCATE_PARAMETERS,
    ALLOCATE_SLOTS_PARAMETERS,
    BLOCK_POOL_PARAMETERS,
    COORDINATOR_PARAMETERS,
    group_kernel_block_size,
    vllm_patch_set,
)
from kvshare.runtime.engines.vllm_cpu_worker import cpu_worker_patches
from kvshare.runtime.engines.vllm_tensors import allocating_from_pool

_ALLOCATE = (*ALLOCATE_PARAMETERS, "allocate")


def without_extensible_kv_cache(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``VllmConfig._resolve_extensible_kv_cache``: the extensible KV cache is
    settled off (kvshare's pool is the KV allocation); asked for explicitly, refused."""

    def _resolve_extensible_kv_cache(self: Any) -> None:
        cache_config = self.cache_config
        if not cache_config._extensible_kv_cache_resolved:
            if cache_config.enable_extensible_kv_cache:
                raise EngineConfigError(
                    "vLLM's extensible KV cache (--enable-extensible-kv-cache) reserves and "
                    "commits KV memory of its own; with kvshare the pool is the KV "
                    "allocation: drop the flag (kvshare turns the cache off)"
                )
            cache_config.enable_extensible_kv_cache = False
        original(self)

    return _resolve_extensible_kv_cache


def _allocator(module: str) -> Patch:
    return Patch(
        Target(module, "allocate_kv_cache", _ALLOCATE),
        allocating_from_pool(group_kernel_block_size),
        "KV cache tensors over the pool's reserved range",
    )


PATCHES = vllm_patch_set(
    "0.34.x",
    coordinator_parameters=(*COORDINATOR_PARAMETERS, "num_hash_lookahead_tokens"),
    block_pool_parameters=(*BLOCK_POOL_PARAMETERS, "num_hash_lookahead_tokens", "medium"),
    kernel_block_size=group_kernel_block_size,
    allocate_slots_parameters=(*ALLOCATE_SLOTS_PARAMETERS, "skip_zeroing_group_ids"),
    deferred=(
        cpu_worker_patches(
            "0.34.x",
            runner_module="vllm.v1.worker.cpu.model_runner",
            allocators=(_allocator("vllm.v1.worker.cpu.attn_utils"),),
        ),
    ),
    allocators=(Target("vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache", _ALLOCATE),),
    free_blocks_parameters=("self", "ordered_blocks", "evict_first"),
    extra=(
        Patch(
            Target("vllm.config.vllm", "VllmConfig._resolve_extensible_kv_cache", ("self",)),
            without_extensible_kv_cache,
            "vLLM's extensible KV cache stays off: the pool is the KV allocation",
        ),
    ),
)
