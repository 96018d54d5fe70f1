"""The real memory geometry of each engine's KV pool, in kvshare's own terms.

Every model's KV pool is a :class:`~kvshare.runtime.geometry.KVGeometry` with the
model's real bytes (:class:`~kvshare.twin.models.Footprint`), in one of the two layouts
kvshare's vLLM hooks build (``runtime/engines/vllm_common.py``, ``plan_pool``):

- ``per-layer`` (today's pools, vLLM's layer-outer layouts): one buffer per layer
  holding that layer's K and V of every block; a logical page is one 2 MiB granule of
  every buffer. Llama-3.1-8B: blocks of 16 tokens are 64 KiB per layer, so a logical page
  is 32 blocks, 64 MiB of the GPU.
- ``block-outer`` (vLLM's block-outer layouts, which kvshare's hooks ask vLLM for from
  this release on): one buffer of whole blocks of all layers,
  ``KVGeometry(1, block_stride, ...)``, and a page is the smallest run of 2 MiB granules
  that holds whole blocks (Llama-3.1-8B: one 2 MiB block per page; Qwen3-8B's
  2.25 MiB blocks: 8 blocks in 18 MiB).

The page is what memory moves in: a pool maps and unmaps whole logical pages, and a page
comes back only when its last block is freed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pool_lease import DEFAULT_LEASE_CHUNK_BYTES
from kvshare.twin.models import Footprint

__all__ = ["GRANULE", "PAGE_LAYOUTS", "PageLayout", "PoolShape", "pool_shape"]

#: The CUDA driver's mapping granularity on the GPUs the twin knows.
GRANULE = 2 * 2**20
PageLayout = Literal["per-layer", "block-outer"]
PAGE_LAYOUTS: tuple[PageLayout, ...] = ("block-outer", "per-layer")


@dataclass(frozen=True)
class PoolShape:
    """One model's pool on the twin's GPU."""

    geometry: KVGeometry
    #: The lease growth step: the runtime's default, in whole logical pages.
    chunk_bytes: int

    @property
    def block_bytes(self) -> int:
        """GPU bytes one block id stands for (all buffers)."""
        return self.geometry.block_bytes_all_buffers

    @property
    def blocks_per_page(self) -> int:
        """Whole blocks in one logical page."""
        return self.geometry.page_size // self.geometry.block_bytes

    @property
    def page_bytes(self) -> int:
        """GPU bytes of one logical page."""
        return self.geometry.page_bytes


def pool_shape(
    footprint: Footprint,
    capacity_bytes: int,
    layout: PageLayout,
    *,
    granule: int = GRANULE,
    lease_chunk_bytes: int = DEFAULT_LEASE_CHUNK_BYTES,
) -> PoolShape:
    """The pool of ``footprint``'s model in ``layout``, with room for ``capacity_bytes``
    of KV cache (the most it could ever lease) and its null block, mapped in ``granule``
    bytes per buffer and leased in steps of ``lease_chunk_bytes`` (rounded to whole
    logical pages)."""
    block = footprint.block_bytes
    if layout == "block-outer":
        buffers, block_bytes = 1, block
        page = math.lcm(block, granule)
    elif layout == "per-layer":
        buffers = footprint.architecture.layers
        block_bytes, rest = divmod(block, buffers)
        if rest:
            raise ValueError(f"a block of {block} bytes does not split into {buffers} layers")
        page = max(granule, math.lcm(block_bytes, granule) if block_bytes > granule else granule)
    else:
        raise ValueError(f"page layout {layout!r} is not one of {', '.join(PAGE_LAYOUTS)}")
    per_page = page // block_bytes
    blocks = capacity_bytes // block + 1
    geometry = KVGeometry(
        num_buffers=buffers,
        block_bytes=block_bytes,
        num_blocks=-(-blocks // per_page) * per_page,
        page_size=page,
        layout="per-layer",
    )
    chunk = max(1, lease_chunk_bytes // geometry.page_bytes) * geometry.page_bytes
    return PoolShape(geometry, chunk)
