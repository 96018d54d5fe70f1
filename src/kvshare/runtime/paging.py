"""How a pool's pages hold the engine's blocks: block-outer or per-layer, and why.

A pool maps physical memory in logical pages (:mod:`kvshare.runtime.geometry`). What one
page holds depends on how the engine lays out its KV cache:

``block-outer``
    The engine keeps all layers of one block together (vLLM's ``BLNHC``/``BLHNC``): the
    pool has one buffer of whole blocks and a page is the smallest run of granules
    (``KVSHARE_PAGE_SIZE``, the hardware's 2 MiB) that holds whole blocks of all layers —
    one granule for an 8B model with 16-token blocks, four with 64-token blocks. The pool
    grows, shrinks, retires and unmaps by the block.
``per-layer``
    The engine keeps each layer's blocks together (vLLM's ``LBNHC``/``LBHNC``, SGLang's
    per-layer K and V buffers): a page is one granule in every layer's buffer, so it
    moves ``layers`` granules at a time and holds as many blocks as one granule of one
    layer does; it comes back only once all of them are free.

:class:`Paging` is what a pool says about this (in its reports, and so in the node
agent's ``/metrics``); :data:`LAYOUT_REASONS` are the reasons a pool keeps per-layer pages.
:func:`block_outer_page_size` and :func:`tiling_advice` size a block-outer page and say
what a block that does not tile the granule wastes, and the block size that would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LAYOUT_REASONS",
    "PAGE_LAYOUTS",
    "LayoutReason",
    "PageLayout",
    "Paging",
    "block_outer_page_size",
    "tiling_advice",
]

PageLayout = Literal["block-outer", "per-layer"]
PAGE_LAYOUTS: tuple[PageLayout, ...] = ("block-outer", "per-layer")

LayoutReason = Literal["", "setting", "engine-setting", "backend", "model", "connector", "engine"]
#: Why a pool keeps per-layer pages (``""``: it does not, or nobody said).
LAYOUT_REASONS: dict[LayoutReason, str] = {
    "": "no reason stated",
    "setting": "KVSHARE_LAYOUT=per-layer asks for per-layer pages",
    "engine-setting": "the engine was told a layer-outer KV layout (e.g. VLLM_KV_CACHE_LAYOUT)",
    "backend": "an attention backend in use supports no block-outer KV layout",
    "model": "the model has several KV cache groups (hybrid attention)",
    "connector": "the KV connector asked for a layer-outer KV layout",
    "engine": "the engine keeps one KV buffer per layer",
}


@dataclass(frozen=True)
class Paging:
    """What one pool's pages hold, and (for per-layer pages) why."""

    layout: PageLayout = "per-layer"
    reason: LayoutReason = ""
    detail: str = ""
    """The reason in the engine's own words (backends and their layouts), for the log."""

    def describe(self) -> str:
        """One sentence for the log."""
        if self.layout == "block-outer":
            return "block-outer pages: one page holds whole blocks of every layer"
        why = LAYOUT_REASONS[self.reason]
        return f"per-layer pages: {why}" + (f" ({self.detail})" if self.detail else "")


def block_outer_page_size(block_bytes: int, granule: int) -> int:
    """The smallest run of granules that holds at least one whole block of all layers."""
    if block_bytes <= 0 or granule <= 0:
        raise ValueError(f"block ({block_bytes}) and granule ({granule}) must be > 0 bytes")
    return -(-block_bytes // granule) * granule


def tiling_advice(block_bytes: int, block_tokens: int, granule: int) -> str | None:
    """``None`` when blocks of ``block_bytes`` tile runs of ``granule`` exactly; else what
    each block-outer page leaves unused and the block size (tokens) that would not.

    A block tiles when it divides a granule or is a whole number of them. A token of all
    layers takes ``block_bytes / block_tokens`` bytes; the block sizes that tile are the
    multiples of ``granule / gcd(granule, token bytes)`` tokens (and, when a token's bytes
    divide the granule, the divisors of a granule's worth of tokens).
    """
    page = block_outer_page_size(block_bytes, granule)
    unused = page % block_bytes
    if unused == 0:
        return None
    per_token, rest = divmod(block_bytes, block_tokens)
    blocks = page // block_bytes
    waste = (
        f"a block of {block_tokens} tokens is {block_bytes} bytes for all layers, which does "
        f"not tile {granule}-byte granules: each page of {page} bytes holds {blocks} "
        f"block{'s' if blocks > 1 else ''} and leaves {unused} bytes "
        f"({unused / page:.0%}) unused"
    )
    if rest:
        return f"{waste}; choose a block size whose bytes tile the granule"
    step = granule // math.gcd(granule, per_token)
    return (
        f"{waste}; a block size that is a multiple of {step} tokens (vLLM: --block-size "
        f"{step}) wastes nothing"
    )
