"""The shape of an engine's KV cache, and where each block and page lives in virtual memory.

A pool reserves one virtual range for ``num_buffers`` buffers (one per layer and per K/V,
or one per layer for MLA), each ``num_blocks`` blocks of ``block_bytes``. Physical memory
comes in *logical pages*: logical page ``p`` is the physical memory behind the same block
range of every buffer, so mapping one logical page makes the same blocks usable in all
layers at once.

Layouts
-------
``per-layer`` (default)
    Buffer ``i`` starts at ``i * buffer_stride`` (page aligned). Block ``b`` of buffer
    ``i`` is at ``i * buffer_stride + b * block_bytes``. Logical page ``p`` is
    ``num_buffers`` physical pages of ``page_size``, one at offset ``p * page_size`` of
    every buffer.
``contiguous``
    One buffer of compound blocks: block ``b`` of buffer ``i`` is at
    ``(b * num_buffers + i) * block_bytes``. Logical page ``p`` is one physical range of
    ``num_buffers * page_size`` bytes at ``p * num_buffers * page_size``.

In both layouts logical page ``p`` holds the same block ids: the blocks whose bytes lie
entirely inside ``[p * page_size, (p + 1) * page_size)`` of a buffer. A block never
straddles two pages; when ``page_size`` is not a multiple of ``block_bytes`` the block id
that would straddle a boundary is never handed out (the engine's tensors keep a uniform
stride, and at most one block per page is lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvshare.runtime.errors import GeometryError

__all__ = ["DEFAULT_PAGE_SIZE", "KVGeometry", "Layout"]

Layout = Literal["per-layer", "contiguous"]
DEFAULT_PAGE_SIZE = 2 * 2**20
_LAYOUTS = ("per-layer", "contiguous")


def _suggest_page_size(block_bytes: int, page_size: int) -> int:
    """A page size that holds ``block_bytes`` blocks: a multiple of the current page size,
    preferably one that wastes nothing."""
    rounded = -(-block_bytes // page_size) * page_size
    exact = math.lcm(block_bytes, page_size)
    return exact if exact <= 8 * rounded else rounded


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache of one worker: buffers, blocks and the physical page size.

    Raises :class:`~kvshare.runtime.errors.GeometryError` when the numbers cannot be
    served, naming the setting to change.
    """

    num_buffers: int
    """Virtual buffers: ``2 * num_layers`` (K and V), or ``num_layers`` for MLA."""
    block_bytes: int
    """Bytes of one block (vLLM) or token slot (SGLang) in one buffer."""
    num_blocks: int
    """Virtual capacity in blocks per buffer, the null block 0 included."""
    page_size: int = DEFAULT_PAGE_SIZE
    """Bytes of one physical page in one buffer; a multiple of the backend's granularity."""
    layout: Layout = "per-layer"
    """``per-layer`` (one buffer per layer and K/V) or ``contiguous`` (one buffer)."""

    def __post_init__(self) -> None:
        for name in ("num_buffers", "block_bytes", "num_blocks", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise GeometryError(
                    f"KV geometry: {name} must be a positive integer, not {value!r}"
                )
        if self.num_blocks < 2:
            raise GeometryError(
                f"KV geometry: num_blocks={self.num_blocks} leaves no block besides the "
                "null block 0; size the cache for at least 2 blocks"
            )
        if self.layout not in _LAYOUTS:
            raise GeometryError(
                f"KV geometry: layout {self.layout!r} is not one of {', '.join(_LAYOUTS)}"
            )
        if self.block_bytes > self.page_size:
            suggestion = _suggest_page_size(self.block_bytes, self.page_size)
            raise GeometryError(
                f"KV geometry: a block of {self.block_bytes} bytes does not fit a page of "
                f"{self.page_size} bytes (blocks never straddle pages); set the page size to "
                f"{suggestion} bytes (KVSHARE_PAGE_SIZE={suggestion}) or use smaller blocks"
            )

    def check_granularity(self, granularity: int) -> None:
        """Raise unless the page size is a multiple of the backend's mapping granularity."""
        if self.page_size % granularity:
            suggestion = -(-self.page_size // granularity) * granularity
            raise GeometryError(
                f"KV geometry: page size {self.page_size} is not a multiple of the backend's "
                f"granularity {granularity}; use {suggestion} (KVSHARE_PAGE_SIZE={suggestion})"
            )

    # --- sizes -----------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Logical pages in the virtual range (the last one may be partly beyond the blocks)."""
        return -(-self.num_blocks * self.block_bytes // self.page_size)

    @property
    def page_bytes(self) -> int:
        """Physical bytes behind one logical page (all buffers): the unit of growth."""
        return self.num_buffers * self.page_size

    @property
    def buffer_stride(self) -> int:
        """Distance between the starts of adjacent buffers (per-layer layout), page aligned."""
        return self.num_pages * self.page_size

    @property
    def page_stride(self) -> int:
        """Distance between the starts of logical pages ``p`` and ``p + 1``."""
        return self.page_bytes if self.layout == "contiguous" else self.page_size

    @property
    def virtual_bytes(self) -> int:
        """Size of the whole reserved virtual range."""
        return self.num_pages * self.page_bytes

    @property
    def block_bytes_all_buffers(self) -> int:
        """Bytes one block id stands for across all buffers."""
        return self.num_buffers * self.block_bytes

    # --- where blocks and pages are ----------------------------------------------------

    def page_of(self, block: int) -> int:
        """The logical page holding ``block`` (the page where its first byte lies)."""
        return block * self.block_bytes // self.page_size

    def blocks_of(self, page: int) -> range:
        """Block ids that lie entirely inside logical page ``page``."""
        start = -(-page * self.page_size // self.block_bytes)
        end = min((page + 1) * self.page_size // self.block_bytes, self.num_blocks)
        return range(start, max(start, end))

    def page_chunks(self, page: int) -> list[tuple[int, int]]:
        """``(offset, size)`` ranges, relative to the reservation, that back logical ``page``."""
        start = page * self.page_stride
        if self.layout == "contiguous":
            return [(start, self.page_bytes)]
        return [(i * self.buffer_stride + start, self.page_size) for i in range(self.num_buffers)]

    def buffer_view(
        self, first: int, count: int
    ) -> tuple[int, tuple[int, int, int], tuple[int, int, int]]:
        """``(offset, shape, strides)`` in bytes of buffers ``[first, first + count)`` seen as a
        ``(count, num_blocks, block_bytes)`` uint8 array over the reservation."""
        if count < 1 or first < 0 or first + count > self.num_buffers:
            raise GeometryError(
                f"buffers [{first}, {first + count}) are outside the pool's "
                f"{self.num_buffers} buffers"
            )
        shape = (count, self.num_blocks, self.block_bytes)
        if self.layout == "contiguous":
            return (
                first * self.block_bytes,
                shape,
                (self.block_bytes, self.block_bytes_all_buffers, 1),
            )
        return first * self.buffer_stride, shape, (self.buffer_stride, self.block_bytes, 1)
