"""Step ``page_ops``: what one pool page costs, call by call, against the bare driver.

The ``cuda`` backend's create / map (with set-access) / unmap / release of a page, and the
same for a whole pool page as the pool does it (every buffer's chunk, bookkeeping and the
device fence included), against the bare driver calls (``cuMemCreate``, ``cuMemMap``,
``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``) in the same run. In a dry run the
bare calls are their libc analogues on the host backend.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpucheck.machine import MIB, Setup


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 2)


def _timed(fn: Callable[[], Any], out: list[float]) -> Any:
    start = time.perf_counter()
    value = fn()
    out.append(time.perf_counter() - start)
    return value


def backend_page_ops(setup: Setup, pages: int) -> tuple[int, dict[str, float]]:
    """Median µs per page of the kvshare backend's create, map, unmap and release."""
    from kvshare.runtime.backends import open_backend

    backend = open_backend(setup.backend, 0)  # type: ignore[arg-type]
    size = max(backend.granularity, 2 * MIB)
    times: dict[str, list[float]] = {"create": [], "map": [], "unmap": [], "release": []}
    try:
        base = backend.reserve(pages * size)
        handles = [_timed(lambda: backend.create(size), times["create"]) for _ in range(pages)]
        for i, handle in enumerate(handles):
            _timed(lambda i=i, h=handle: backend.map(base + i * size, size, h), times["map"])
        for i in range(pages):
            _timed(lambda i=i: backend.unmap(base + i * size, size), times["unmap"])
        for handle in handles:
            _timed(lambda h=handle: backend.release(h), times["release"])
        backend.free_reservation(base)
    finally:
        backend.close()
    return size, {op: _median_us(samples) for op, samples in times.items()}


def _bare_times() -> dict[str, list[float]]:
    """Samples per bare call, by operation."""
    return {op: [] for op in ("create", "map", "set_access", "unmap", "release")}


def bare_cuda_page_ops(size: int, pages: int) -> dict[str, float]:
    """Median µs per page of the driver's own calls (cuda-python, no kvshare code)."""
    from cuda.bindings import driver as cu

    def check(result: Any) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return result[1] if isinstance(result, tuple) and len(result) == 2 else result

    check(cu.cuInit(0))
    device = check(cu.cuDeviceGet(0))
    context = check(cu.cuDevicePrimaryCtxRetain(device))
    check(cu.cuCtxSetCurrent(context))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    times = _bare_times()
    base = int(check(cu.cuMemAddressReserve(pages * size, 0, 0, 0)))
    try:
        handles = [
            _timed(lambda: check(cu.cuMemCreate(size, prop, 0)), times["create"])
            for _ in range(pages)
        ]
        for i, handle in enumerate(handles):
            ptr = cu.CUdeviceptr(base + i * size)
            _timed(lambda p=ptr, h=handle: check(cu.cuMemMap(p, size, 0, h, 0)), times["map"])
            _timed(
                lambda p=ptr: check(cu.cuMemSetAccess(p, size, [access], 1)),
                times["set_access"],
            )
        for i in range(pages):
            ptr = cu.CUdeviceptr(base + i * size)
            _timed(lambda p=ptr: check(cu.cuMemUnmap(p, size)), times["unmap"])
        for handle in handles:
            _timed(lambda h=handle: check(cu.cuMemRelease(h)), times["release"])
    finally:
        check(cu.cuMemAddressFree(cu.CUdeviceptr(base), pages * size))
    return {op: _median_us(samples) for op, samples in times.items()}


def bare_host_page_ops(size: int, pages: int) -> dict[str, float]:
    """The host analogue of the driver calls, straight from libc (dry run)."""
    from kvshare.runtime.backends import libc

    times = _bare_times()
    fd = os.memfd_create("kvshare-gpu-check")
    try:
        os.ftruncate(fd, pages * size)
        flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
        base = libc.mmap(0, pages * size, libc.PROT_NONE, flags)
        try:
            for i in range(pages):
                _timed(lambda i=i: libc.fallocate(fd, 0, i * size, size), times["create"])
            for i in range(pages):
                _timed(
                    lambda i=i: libc.map_shared_fixed(base + i * size, size, fd, i * size),
                    times["map"],
                )
                times["set_access"].append(0.0)  # part of mmap's protection on the host
            for i in range(pages):
                _timed(lambda i=i: libc.protect_none_fixed(base + i * size, size), times["unmap"])
            punch = libc.FALLOC_FL_PUNCH_HOLE | libc.FALLOC_FL_KEEP_SIZE
            for i in range(pages):
                _timed(lambda i=i: libc.fallocate(fd, punch, i * size, size), times["release"])
        finally:
            libc.munmap(base, pages * size)
    finally:
        os.close(fd)
    return {op: _median_us(samples) for op, samples in times.items()}


class TimedDriver:
    """A CUDA driver that times each call the backend makes (the per-call cost inside one
    kvshare operation: a map is ``cuMemMap`` then ``cuMemSetAccess``)."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.times: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._driver, name)
        if not name.startswith("mem_"):
            return call

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.times.setdefault(name, []).append(time.perf_counter() - start)

        return timed


def _open_timed(setup: Setup) -> tuple[Any, TimedDriver | None]:
    from kvshare.runtime.backends import open_backend

    if setup.dry_run:
        return open_backend("host"), None
    from kvshare.runtime.backends.cuda import CudaBackend
    from kvshare.runtime.backends.cuda_driver import CudaDriver

    driver = TimedDriver(CudaDriver())
    return CudaBackend(0, driver=driver), driver  # type: ignore[arg-type]


def pool_page_ops(setup: Setup, pages: int) -> dict[str, float | None]:
    """Median µs per pool page of what the pool does to a page (its page space: every
    buffer's chunk, bookkeeping, the device fence before an unmap), and of each driver call
    inside (``cuda`` only)."""
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.pages import PageSpace

    backend, driver = _open_timed(setup)
    size = max(backend.granularity, 2 * MIB)
    geometry = KVGeometry(
        num_buffers=2, block_bytes=size // 8, num_blocks=8 * pages, page_size=size
    )
    times: dict[str, list[float]] = {"create": [], "map": [], "unmap": [], "release": []}
    try:
        space = PageSpace(geometry, backend)
        for op in ("create", "map", "unmap", "release"):
            for page in range(pages):
                _timed(lambda op=op, page=page: getattr(space, op)([page]), times[op])
        space.close()
    finally:
        backend.close()
    result: dict[str, float | None] = {
        f"pool_{op}_us": _median_us(samples) for op, samples in times.items()
    }
    calls = {"create": "mem_create", "map": "mem_map", "set_access": "mem_set_access"}
    calls |= {"unmap": "mem_unmap", "release": "mem_release"}
    for op, call in calls.items():
        samples = driver.times.get(call) if driver is not None else None
        result[f"pool_driver_{op}_us"] = _median_us(samples) if samples else None
    return result


def measure_page_ops(setup: Setup) -> dict[str, Any]:
    pages = 64
    size, ours = backend_page_ops(setup, pages)
    bare = bare_host_page_ops(size, pages) if setup.dry_run else bare_cuda_page_ops(size, pages)
    bare_map = bare["map"] + bare["set_access"]
    result: dict[str, Any] = {"page_bytes": size, "pages": pages}
    for op in ("create", "unmap", "release"):
        result[f"{op}_us"] = ours[op]
        result[f"bare_{op}_us"] = bare[op]
    result["map_us"] = ours["map"]
    result["bare_map_us"] = bare["map"]
    result["bare_set_access_us"] = bare["set_access"]
    result["map_overhead_ratio"] = round(ours["map"] / bare_map, 3) if bare_map else None
    result["create_overhead_ratio"] = round(ours["create"] / bare["create"], 3)
    result |= pool_page_ops(setup, pages)
    result["ok"] = all(result[f"pool_{op}_us"] > 0 for op in ("create", "map", "unmap", "release"))
    return result
