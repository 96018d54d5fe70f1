"""KV geometry: bad configurations are refused with the setting to change; blocks never
straddle pages; both layouts place every block where the engine's tensor expects it."""

from __future__ import annotations

import pytest

from kvshare.runtime.errors import GeometryError
from kvshare.runtime.geometry import KVGeometry

MIB = 2**20


def test_a_block_larger_than_a_page_names_the_page_size_to_use() -> None:
    with pytest.raises(GeometryError) as info:
        KVGeometry(num_buffers=2, block_bytes=3 * MIB, num_blocks=100, page_size=2 * MIB)
    message = str(info.value)
    assert "does not fit a page of 2097152 bytes" in message
    assert "KVSHARE_PAGE_SIZE=6291456" in message  # 6 MiB holds two 3 MiB blocks exactly


def test_page_size_must_be_a_multiple_of_the_backend_granularity() -> None:
    geometry = KVGeometry(num_buffers=1, block_bytes=4096, num_blocks=10, page_size=3 * MIB)
    geometry.check_granularity(MIB)
    with pytest.raises(GeometryError, match=r"granularity 2097152; use 4194304"):
        geometry.check_granularity(2 * MIB)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_buffers", 0), ("block_bytes", -1), ("num_blocks", 1), ("page_size", 1.5)],
)
def test_non_positive_or_non_integer_sizes_are_refused(field: str, value: object) -> None:
    fields: dict[str, object] = {"num_buffers": 2, "block_bytes": 4096, "num_blocks": 64}
    fields[field] = value
    with pytest.raises(GeometryError, match=field if field != "num_blocks" else "null block"):
        KVGeometry(**fields)  # type: ignore[arg-type]


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(GeometryError, match="per-layer, contiguous"):
        KVGeometry(num_buffers=2, block_bytes=4096, num_blocks=64, layout="paged")  # type: ignore[arg-type]


def test_blocks_that_would_straddle_a_page_belong_to_no_page() -> None:
    # Blocks of 3 KiB in 8 KiB pages: block 2 (6-9 KiB) and block 5 (15-18 KiB) straddle.
    geometry = KVGeometry(num_buffers=1, block_bytes=3072, num_blocks=10, page_size=8192)
    owned = [list(geometry.blocks_of(p)) for p in range(geometry.num_pages)]
    assert owned == [[0, 1], [3, 4], [6, 7], [8, 9]]  # 2 and 5 straddle
    for page, blocks in enumerate(owned):
        for block in blocks:
            start = block * geometry.block_bytes
            assert page * 8192 <= start and start + geometry.block_bytes <= (page + 1) * 8192
            assert geometry.page_of(block) == page


def test_per_layer_pages_are_one_physical_page_in_every_buffer() -> None:
    geometry = KVGeometry(num_buffers=3, block_bytes=4096, num_blocks=40, page_size=16384)
    assert geometry.num_pages == 10
    assert geometry.buffer_stride == 10 * 16384
    assert geometry.page_chunks(2) == [
        (2 * 16384 + i * geometry.buffer_stride, 16384) for i in range(3)
    ]
    assert geometry.virtual_bytes == 3 * geometry.buffer_stride
    offset, shape, strides = geometry.buffer_view(1, 2)
    assert (offset, shape, strides) == (
        geometry.buffer_stride,
        (2, 40, 4096),
        (geometry.buffer_stride, 4096, 1),
    )


def test_contiguous_pages_are_one_compound_range_holding_the_same_blocks() -> None:
    geometry = KVGeometry(
        num_buffers=3, block_bytes=4096, num_blocks=40, page_size=16384, layout="contiguous"
    )
    assert geometry.page_chunks(2) == [(2 * 3 * 16384, 3 * 16384)]
    assert list(geometry.blocks_of(2)) == [8, 9, 10, 11]
    offset, shape, strides = geometry.buffer_view(1, 2)
    assert (offset, shape, strides) == (4096, (2, 40, 4096), (4096, 3 * 4096, 1))
    # Block 9 of buffer 2 lies inside page 2's compound range.
    address = offset + 1 * strides[0] + 9 * strides[1]
    (start, size) = geometry.page_chunks(2)[0]
    assert start <= address and address + 4096 <= start + size


def test_a_view_outside_the_buffers_is_refused() -> None:
    geometry = KVGeometry(num_buffers=2, block_bytes=4096, num_blocks=8)
    with pytest.raises(GeometryError, match=r"buffers \[1, 3\) are outside"):
        geometry.buffer_view(1, 2)
