"""The vLLM KV cache the suite builds: two full-attention layers, planned by vLLM itself;
and the tiny model whose config vLLM's scheduler and workers are built from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BLOCK_TOKENS = 16
PAGE = 64 * 2**10  # 8 blocks of 8 KiB per page and layer
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
VIRTUAL = 2 * 2**20  # 128 blocks
LEASE_PAGES = 5  # page 0 (with the null block) and 4 more: 39 usable blocks


def kv_cache_config(num_bytes: int, layout: str = "LBHNC") -> tuple[Any, Any, Any]:
    """vLLM's own plan for two full-attention layers in ``num_bytes`` under ``layout``: the
    KV cache config (its layout recorded, as the engine core records it), the layout, and
    the cache config it was resolved on (what the scheduler sees)."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # 0.30.x keeps the planner in kv_cache_utils
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    groups = [KVCacheGroupSpec(LAYERS, spec)]
    config = get_kv_cache_config_from_groups(vllm_config, groups, num_bytes)
    config.kv_cache_layout = layout
    cache_config = vllm_config.cache_config
    return config, cache_config.get_resolved_kv_cache_layout(), cache_config


def allocate(config: Any, layout: Any, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The worker's KV cache views, through the model runner's ``allocate_kv_cache`` (the
    V2 runner's, which every supported line has; 0.34 has no other)."""
    from vllm.v1.worker.gpu import attn_utils

    views: dict[str, torch.Tensor] = attn_utils.allocate_kv_cache(
        config, torch.device(device), layout, None
    )
    return views


#: A Llama of two small layers (a ``config.json``, no weights): enough for vLLM's configs.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def model_config(directory: Path) -> Any:
    """vLLM's ``ModelConfig`` of :data:`MODEL`, written to ``directory``."""
    from vllm.config import ModelConfig

    (directory / "config.json").write_text(json.dumps(MODEL))
    return ModelConfig(
        model=str(directory), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512
    )
