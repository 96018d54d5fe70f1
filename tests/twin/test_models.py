"""Model geometry: KV bytes per token, weights, what tensor parallelism halves, and models
that one GPU cannot hold."""

from __future__ import annotations

import pytest

from kvshare.twin.gpus import UnknownGpuError, gpu_kind
from kvshare.twin.models import (
    DoesNotFitError,
    UnknownArchitectureError,
    architecture,
    check_fits,
    footprint,
)
from kvshare.twin.workload import ModelSpec

GIB = 2**30


def test_llama_3_1_8b_keeps_128_kib_of_kv_per_token_in_bf16() -> None:
    assert architecture("meta-llama/Llama-3.1-8B").kv_bytes_per_token() == 128 * 2**10


@pytest.mark.parametrize(
    ("name", "published_billions"),
    # The model cards' parameter counts.
    [
        ("meta-llama/Llama-3.1-8B", 8.03),
        ("meta-llama/Llama-3.1-70B", 70.6),
        ("Qwen/Qwen3-8B", 8.2),
        ("Qwen/Qwen3-1.7B", 1.7),
        ("Qwen/Qwen3-0.6B", 0.6),
    ],
)
def test_parameters_from_the_config_match_the_published_counts(
    name: str, published_billions: float
) -> None:
    assert architecture(name).parameters / 1e9 == pytest.approx(published_billions, rel=0.02)


def test_weights_agree_with_aiconfigurators_count_where_the_output_head_is_untied() -> None:
    """AIConfigurator counts the output head's GEMM even when it shares the embeddings'
    weights (Qwen3's small models); where it does not, both counts agree."""
    gpu = gpu_kind("h200_sxm")
    for name in ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B"):
        item = footprint(ModelSpec("m", name), gpu)
        from kvshare.twin.steps import load_table

        aic = load_table("h200_sxm", name, "vllm", 1).memory.aic_weight_bytes
        assert item.weight_bytes == pytest.approx(aic, rel=0.01)


def test_tensor_parallelism_halves_what_one_gpu_holds() -> None:
    llama = architecture("meta-llama/Llama-3.1-70B")
    assert llama.kv_bytes_per_token(2) * 2 == llama.kv_bytes_per_token(1)
    assert llama.weight_bytes(2) * 2 == pytest.approx(llama.weight_bytes(1), abs=1)
    gpu = gpu_kind("h200_sxm")
    one = footprint(ModelSpec("a", llama.name, tensor_parallel=2), gpu)
    two = footprint(ModelSpec("a", llama.name, tensor_parallel=4), gpu)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert two.weight_bytes * 2 == pytest.approx(one.weight_bytes, abs=1)


def test_more_gpus_than_kv_heads_replicate_one_head_per_gpu() -> None:
    llama = architecture("meta-llama/Llama-3.1-8B")  # 8 KV heads
    assert llama.kv_bytes_per_token(16) == llama.kv_bytes_per_token(8)


def test_an_8b_model_on_an_h200_keeps_its_weights_and_about_4_gib_more() -> None:
    item = footprint(ModelSpec("m", "meta-llama/Llama-3.1-8B"), gpu_kind("h200_sxm"))
    assert item.weight_bytes / GIB == pytest.approx(14.96, abs=0.01)
    assert 3.5 < (item.static_bytes - item.weight_bytes) / GIB < 5


def test_a_70b_model_on_one_h200_is_refused_and_fits_with_tensor_parallelism() -> None:
    gpu = gpu_kind("h200_sxm")
    alone = footprint(ModelSpec("big", "meta-llama/Llama-3.1-70B"), gpu)
    with pytest.raises(DoesNotFitError, match=r"big .*does not fit a h200_sxm.*tensor_parallel"):
        check_fits([alone], gpu, [GIB])
    split = footprint(ModelSpec("big", "meta-llama/Llama-3.1-70B", tensor_parallel=2), gpu)
    assert check_fits([split], gpu, [GIB]) > 50 * GIB


def test_too_many_models_for_one_gpu_are_refused_with_the_numbers() -> None:
    gpu = gpu_kind("h200_sxm")
    models = [footprint(ModelSpec(f"m{i}", "meta-llama/Llama-3.1-8B"), gpu) for i in range(7)]
    with pytest.raises(DoesNotFitError, match=r"7 models do not fit one h200_sxm.*GiB"):
        check_fits(models, gpu, [GIB] * 7)
    assert check_fits(models[:6], gpu, [GIB] * 6) > 6 * GIB


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: gpu_kind("v100"), UnknownGpuError, "h200_sxm"),
        (lambda: architecture("x/unknown"), UnknownArchitectureError, "Llama-3.1-8B"),
    ],
)
def test_unknown_names_are_refused_with_the_known_ones(call, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        call()


def test_vllm_defaults_follow_the_gpus_memory_class() -> None:
    # vllm/engine/arg_utils.py, get_batch_defaults, OpenAI server.
    assert (gpu_kind("b200_sxm").vllm_max_batched_tokens, gpu_kind("b200_sxm").vllm_max_seqs) == (
        16384,
        1024,
    )
    assert gpu_kind("h200_sxm").vllm_max_batched_tokens == 8192
    assert gpu_kind("h100_sxm").vllm_max_batched_tokens == 8192
    assert (gpu_kind("a100_sxm").vllm_max_batched_tokens, gpu_kind("a100_sxm").vllm_max_seqs) == (
        2048,
        256,
    )
    assert gpu_kind("l40s").vllm_max_batched_tokens == 2048
