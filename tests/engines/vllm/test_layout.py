"""Which KV cache layout kvshare asks vLLM for, through vLLM's own resolution.

vLLM's engine core resolves one layout from the layouts its workers' attention backends
support (``resolve_kv_cache_layout``). kvshare's wrapper puts the block-outer ones first;
vLLM's own rules then pick one exactly when every backend supports it. The backends'
supported sets are read from vLLM's own classes: FLASH_ATTN (any layout), FlexAttention
(``LBNHC`` only) and the CPU backend (``LBHNC`` only, what ``vllm serve`` on a CPU gets).
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvshare.api import env
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.engines.vllm_layout import asking_for_block_outer, explain


def _supported(backend: str) -> list[str]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    classes = {
        "FLASH_ATTN": FlashAttentionBackend,
        "FLEX_ATTENTION": FlexAttentionBackend,
        "CPU_ATTN": CPUAttentionBackend,
    }
    return [layout.name for layout in get_supported_kv_cache_layouts([classes[backend]])]


def _specs(*head_sizes: int) -> list[object]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return [
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=size, dtype=torch.float16)
        for size in head_sizes
    ]


def _resolve(backend: str, specs: list[object], *, kvshare: bool = True) -> str:
    """The layout vLLM's engine core resolves for one worker of ``backend``."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    resolve = (
        asking_for_block_outer(resolve_kv_cache_layout) if kvshare else resolve_kv_cache_layout
    )
    return str(resolve(config, [_supported(backend)], specs).name)


@pytest.fixture(autouse=True)
def no_layout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.LAYOUT.name, raising=False)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def test_vllm_resolves_a_block_outer_layout_where_kvshare_asks_and_the_backend_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM's own preference puts the layer-outer LBNHC first.
    assert _resolve("FLASH_ATTN", _specs(64, 64), kvshare=False) == "LBNHC"
    with caplog.at_level(logging.INFO, logger="kvshare"):
        assert _resolve("FLASH_ATTN", _specs(64, 64)) == "BLNHC"
    assert "layout BLNHC gives block-outer pages" in caplog.text


@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "CPU_ATTN"])
def test_a_backend_without_block_outer_layouts_keeps_per_layer_pages_and_says_why(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvshare"):
        resolved = _resolve(backend, _specs(64, 64))
    assert resolved == _supported(backend)[0]
    assert "per-layer pages: an attention backend in use supports no block-outer" in caplog.text
    paging = explain(resolved, _supported(backend), several_groups=False, requested=None)
    assert (paging.layout, paging.reason) == ("per-layer", "backend")


def test_a_hybrid_model_is_not_asked_for_a_block_outer_layout() -> None:
    # Two KV cache groups of different shapes share blocks: vLLM keeps its own order.
    assert _resolve("FLASH_ATTN", _specs(64, 128)) == "LBNHC"
    paging = explain("LBNHC", _supported("FLASH_ATTN"), several_groups=True, requested=None)
    assert (paging.layout, paging.reason) == ("per-layer", "model")


def test_kvshare_layout_per_layer_leaves_vllm_s_own_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.LAYOUT.name, "per-layer")
    assert _resolve("FLASH_ATTN", _specs(64, 64)) == "LBNHC"


def test_kvshare_layout_block_outer_fails_start_up_where_vllm_cannot_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.LAYOUT.name, "block-outer")
    assert _resolve("FLASH_ATTN", _specs(64, 64)) == "BLNHC"
    with pytest.raises(EngineConfigError, match=r"KVSHARE_LAYOUT=block-outer.*resolved .*LBNHC"):
        _resolve("FLEX_ATTENTION", _specs(64, 64))


def test_an_explicit_vllm_layout_wins_and_is_named_as_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBHNC")
    with caplog.at_level(logging.INFO, logger="kvshare"):
        assert _resolve("FLASH_ATTN", _specs(64, 64)) == "LBHNC"
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC" in caplog.text
