"""Patches for vLLM 0.30.x (see :mod:`kvshare.runtime.engines.vllm_common`).

Differs from 0.33.x in constructor parameters (no hash look-ahead) and in the kernel
block size of MLA layers with their own storage block size.
"""

from __future__ import annotations

from typing import Any

from kvshare.runtime.engines.vllm_common import group_kernel_block_size, vllm_patch_set


def _kernel_block_size(
    spec: Any, group_id: int, kernel_block_sizes: list[int] | None
) -> int | None:
    """As 0.30's ``allocate_kv_cache``: an MLA storage block size wins over the group's."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec) and spec.storage_block_size is not None:
        return int(spec.storage_block_size)
    return group_kernel_block_size(spec, group_id, kernel_block_sizes)


PATCHES = vllm_patch_set(
    "0.30.x",
    coordinator_parameters=(
        "self",
        "kv_cache_config",
        "max_model_len",
        "max_in_flight_tokens",
        "use_eagle",
        "enable_caching",
        "enable_kv_cache_events",
        "dcp_world_size",
        "pcp_world_size",
        "scheduler_block_size",
        "hash_block_size",
        "metrics_collector",
        "num_prefill_lookahead",
    ),
    block_pool_parameters=(
        "self",
        "num_gpu_blocks",
        "enable_caching",
        "hash_block_size",
        "enable_kv_cache_events",
        "metrics_collector",
        "medium",
    ),
    kernel_block_size=_kernel_block_size,
)
