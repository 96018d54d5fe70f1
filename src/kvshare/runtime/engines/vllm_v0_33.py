"""Patches for vLLM 0.33.x (see :mod:`kvshare.runtime.engines.vllm_common`)."""

from __future__ import annotations

from kvshare.runtime.engines.vllm_common import group_kernel_block_size, vllm_patch_set

PATCHES = vllm_patch_set(
    "0.33.x",
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
        "num_hash_lookahead_tokens",
    ),
    block_pool_parameters=(
        "self",
        "num_gpu_blocks",
        "enable_caching",
        "hash_block_size",
        "enable_kv_cache_events",
        "metrics_collector",
        "num_hash_lookahead_tokens",
        "medium",
    ),
    kernel_block_size=group_kernel_block_size,
)
