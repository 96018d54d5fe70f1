"""The cuda backend on a real device: pages are device memory that follows the mapping,
every call stays on the pool's own device, and released memory returns to the driver."""

from __future__ import annotations

import threading

import pytest

from kvshare.runtime.backends.cuda import CudaBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

from .conftest import open_cuda

pytestmark = pytest.mark.gpu

MIB = 2**20


def test_a_page_mapped_at_two_addresses_is_the_same_device_memory(cuda0: CudaBackend) -> None:
    import torch

    page_size = cuda0.granularity
    base = cuda0.reserve(4 * page_size)
    page = cuda0.create(page_size)
    cuda0.map(base, page_size, page)
    first = cuda0.tensor(base, page_size)
    assert first.device == torch.device("cuda", 0)
    first[:4096].fill_(42)
    torch.cuda.synchronize()
    cuda0.unmap(base, page_size)
    cuda0.map(base + 2 * page_size, page_size, page)
    second = cuda0.tensor(base + 2 * page_size, page_size)
    assert int(second[:4096].sum()) == 42 * 4096
    torch.cuda.synchronize()
    cuda0.unmap(base + 2 * page_size, page_size)
    cuda0.release(page)
    cuda0.free_reservation(base)


def test_pool_views_of_k_and_v_share_device_pages(cuda0: CudaBackend) -> None:
    import torch

    geometry = KVGeometry(
        num_buffers=4, block_bytes=64 * 1024, num_blocks=1024, page_size=cuda0.granularity
    )
    pool = KVPool(geometry, cuda0, StaticLease(64 * geometry.page_bytes), reserve_pages=2)
    try:
        ids = pool.alloc(40)
        assert ids
        kv = pool.tensor(2, 2).view(torch.float16).reshape(2, 1024, 16, 2048)
        kv[1, ids[-1]] = 3.0
        v = pool.tensor(3).view(torch.float16).reshape(1024, 16, 2048)
        assert bool(torch.all(v[ids[-1]] == 3.0))
    finally:
        pool.close()


def test_released_pages_return_their_memory_to_the_driver(cuda0: CudaBackend) -> None:
    page_size = cuda0.granularity
    count = max(1, 256 * MIB // page_size)
    before = cuda0.free_memory()
    pages = [cuda0.create(page_size) for _ in range(count)]
    during = cuda0.free_memory()
    for page in pages:
        cuda0.release(page)
    after = cuda0.free_memory()
    assert before - during >= count * page_size - 64 * MIB
    assert abs(after - before) <= 64 * MIB


def test_a_pool_on_device_1_stays_on_device_1_and_restores_the_callers_device() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    backend = open_cuda(1)
    torch.cuda.set_device(0)
    free0_before, _ = torch.cuda.mem_get_info(0)
    free1_before, _ = torch.cuda.mem_get_info(1)
    geometry = KVGeometry(num_buffers=2, block_bytes=2 * MIB, num_blocks=256, page_size=2 * MIB)
    pool = KVPool(geometry, backend, StaticLease(2**30), reserve_pages=4)
    try:
        ids = pool.alloc(100)  # 200 MiB per buffer
        assert ids
        assert torch.cuda.current_device() == 0
        assert pool.tensor(0).device == torch.device("cuda", 1)
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(backend.free_memory()))
        worker.start()
        worker.join()
        free1_now, _ = torch.cuda.mem_get_info(1)
        assert abs(seen[0] - free1_now) <= 64 * MIB  # device 1's number, from a fresh thread
        assert free1_before - free1_now >= 300 * MIB
        free0_now, _ = torch.cuda.mem_get_info(0)
        assert abs(free0_before - free0_now) <= 64 * MIB
    finally:
        pool.close()
    assert torch.cuda.current_device() == 0
