"""The vLLM KV cache the suite builds: two full-attention layers, planned by vLLM itself."""

from __future__ import annotations

from typing import Any

import torch

BLOCK_TOKENS = 16
PAGE = 64 * 2**10  # 8 blocks of 8 KiB per page and layer
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
VIRTUAL = 2 * 2**20  # 128 blocks
LEASE_PAGES = 5  # page 0 (with the null block) and 4 more: 39 usable blocks


def kv_cache_config(num_bytes: int) -> tuple[Any, Any]:
    """vLLM's own plan for two full-attention layers in ``num_bytes``."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # 0.30.x keeps the planner in kv_cache_utils
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    groups = [KVCacheGroupSpec(LAYERS, spec)]
    config = get_kv_cache_config_from_groups(vllm_config, groups, num_bytes)
    return config, vllm_config.cache_config.get_resolved_kv_cache_layout()
