"""A block-outer page's size, and the tiling check: what a block that does not tile the
2 MiB granule wastes, and the block size that would not."""

from __future__ import annotations

import pytest

from kvshare.runtime.paging import LAYOUT_REASONS, Paging, block_outer_page_size, tiling_advice

MIB = 2**20
GRANULE = 2 * MIB
#: Llama-3.1-8B, bf16: 32 layers x 8 KV heads x head size 128 x 2 bytes x K and V.
LLAMA_8B_TOKEN = 32 * 8 * 128 * 2 * 2


@pytest.mark.parametrize(
    ("tokens", "page"),
    [
        (16, GRANULE),  # vLLM's 16-token block of every layer is exactly one granule
        (64, 4 * GRANULE),  # vLLM 0.34's default 64-token block: four granules
        (8, GRANULE),  # two blocks share one granule
    ],
)
def test_a_page_is_the_smallest_run_of_granules_holding_whole_blocks(
    tokens: int, page: int
) -> None:
    block = tokens * LLAMA_8B_TOKEN
    assert block_outer_page_size(block, GRANULE) == page
    assert tiling_advice(block, tokens, GRANULE) is None


def test_a_block_that_does_not_tile_the_granule_is_reported_with_its_waste_and_the_fix() -> None:
    # 24 tokens of Llama-3.1-8B are 3 MiB: a page of two granules holds one block and
    # leaves a quarter unused; blocks of any multiple of 16 tokens would not.
    advice = tiling_advice(24 * LLAMA_8B_TOKEN, 24, GRANULE)
    assert advice is not None
    assert "each page of 4194304 bytes holds 1 block and leaves 1048576 bytes (25%)" in advice
    assert "a multiple of 16 tokens (vLLM: --block-size 16) wastes nothing" in advice


def test_the_advised_block_size_tiles_for_a_token_size_that_is_no_power_of_two() -> None:
    # 40 layers x 8 KV heads x 128 x 2 bytes x K and V: 160 KiB a token.
    token = 40 * 8 * 128 * 2 * 2
    advice = tiling_advice(16 * token, 16, GRANULE)
    assert advice is not None and "a multiple of 64 tokens (vLLM: --block-size 64)" in advice
    assert tiling_advice(64 * token, 64, GRANULE) is None  # 10 MiB: five whole granules


def test_a_block_whose_bytes_are_not_whole_tokens_gets_no_block_size_it_cannot_use() -> None:
    advice = tiling_advice(3 * MIB + 1, 16, GRANULE)
    assert advice is not None and advice.endswith(
        "choose a block size whose bytes tile the granule"
    )


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        block_outer_page_size(0, GRANULE)


def test_every_reason_for_per_layer_pages_reads_as_a_sentence() -> None:
    assert Paging("block-outer").describe().startswith("block-outer pages")
    for reason in LAYOUT_REASONS:
        described = Paging("per-layer", reason, "detail").describe()
        assert described == f"per-layer pages: {LAYOUT_REASONS[reason]} (detail)"
