"""The cuda backend's error paths through the real cuda-python bindings, on a CPU machine.

A stub ``libcuda.so.1``, built here with gcc, stands in for the NVIDIA driver (there is
none on this machine). cuda-python finds every driver function through the stub's
``cuGetProcAddress_v2``. One stub answers every call with ``CUDA_ERROR_NO_DEVICE``; the
other answers like a device with virtual memory management whose memory is full, so the
bindings' argument passing for reserve, granularity and free memory runs for real, and
``cuMemCreate`` returns ``CUDA_ERROR_OUT_OF_MEMORY``.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB_SOURCE = r"""
#include <stddef.h>
#include <string.h>
typedef int CUresult;
typedef void *fn;
static CUresult no_device(void) { return 100; }            /* CUDA_ERROR_NO_DEVICE */
static CUresult driver_version(int *v) { *v = 13000; return 0; }
#ifdef FULL_DEVICE
static CUresult ok(void) { return 0; }
static CUresult device_get(int *device, int ordinal) {
    *device = ordinal;
    return ordinal < 2 ? 0 : 101;                          /* CUDA_ERROR_INVALID_DEVICE */
}
static CUresult attribute(int *value, int attribute, int device) { *value = 1; return 0; }
static CUresult ctx_retain(void **ctx, int device) { *ctx = (void *)(0x1000L + device); return 0; }
static CUresult ctx_pop(void **ctx) { if (ctx) *ctx = 0; return 0; }
static CUresult granularity(size_t *g, const void *prop, int option) { *g = 2097152; return 0; }
static CUresult reserve(unsigned long long *p, size_t size, size_t align,
                        unsigned long long addr, unsigned long long flags) {
    *p = 0x7f0000000000ULL; return 0;
}
static CUresult create(unsigned long long *h, size_t size, const void *prop,
                       unsigned long long flags) { return 2; } /* CUDA_ERROR_OUT_OF_MEMORY */
static CUresult get_info(size_t *free_bytes, size_t *total) {
    *free_bytes = 3ULL << 30; *total = 80ULL << 30; return 0;
}
#endif
static const struct { const char *name; fn f; } table[] = {
    {"cuDriverGetVersion", (fn)driver_version},
#ifdef FULL_DEVICE
    {"cuInit", (fn)ok}, {"cuDeviceGet", (fn)device_get},
    {"cuDeviceGetAttribute", (fn)attribute}, {"cuDevicePrimaryCtxRetain", (fn)ctx_retain},
    {"cuDevicePrimaryCtxRelease", (fn)ok}, {"cuCtxPushCurrent", (fn)ok},
    {"cuCtxPopCurrent", (fn)ctx_pop}, {"cuMemGetAllocationGranularity", (fn)granularity},
    {"cuMemAddressReserve", (fn)reserve}, {"cuMemAddressFree", (fn)ok},
    {"cuMemCreate", (fn)create}, {"cuMemGetInfo", (fn)get_info},
#endif
};
CUresult cuGetProcAddress_v2(const char *symbol, fn *pfn, int version,
                             unsigned long long flags, int *status) {
    *pfn = (fn)no_device;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(symbol, table[i].name) == 0) *pfn = table[i].f;
    if (status) *status = 0;
    return 0;
}
CUresult cuGetProcAddress(const char *symbol, fn *pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
CUresult cuDriverGetVersion(int *v) { return driver_version(v); }
CUresult cuInit(unsigned int flags) { return no_device(); }
"""

CHILD = r"""
import json
from kvshare.runtime.backends import open_backend
from kvshare.runtime.errors import BackendUnavailableError, OutOfDeviceMemoryError
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

out = {}
try:
    backend = open_backend("cuda", 0)
except BackendUnavailableError as exc:
    out["unavailable"] = str(exc)
    out["auto"] = open_backend("auto").name
else:
    out["granularity"] = backend.granularity
    out["free"] = backend.free_memory()
    out["reserved"] = hex(backend.reserve(4 * 2**21))
    try:
        backend.create(2**21)
    except OutOfDeviceMemoryError as exc:
        out["create"] = str(exc)
    geometry = KVGeometry(num_buffers=2, block_bytes=2**16, num_blocks=64)
    try:
        KVPool(geometry, open_backend("cuda", 1), StaticLease(2**30))
    except OutOfDeviceMemoryError as exc:
        out["pool"] = str(exc)
    try:
        open_backend("cuda", 5)
    except BackendUnavailableError as exc:
        out["device5"] = str(exc)
print(json.dumps(out))
"""


def build_stub(directory: Path, *defines: str) -> Path:
    directory.mkdir()
    source = directory / "stub.c"
    source.write_text(STUB_SOURCE)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", *defines, "-o", str(directory / "libcuda.so.1"), str(source)],
        check=True,
    )
    return directory


def run_child(stub_dir: Path | None) -> dict[str, str]:
    environ = os.environ.copy()
    if stub_dir is not None:
        environ["LD_LIBRARY_PATH"] = str(stub_dir)
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed"
)
def test_without_a_driver_cuda_is_unavailable_with_the_reason_and_auto_uses_host() -> None:
    result = run_child(None)
    assert result["unavailable"].startswith("no CUDA driver on this machine")
    assert result["auto"] == "host"


@needs_gcc
def test_a_driver_without_devices_makes_cuda_unavailable(tmp_path: Path) -> None:
    result = run_child(build_stub(tmp_path / "nodevice"))
    assert result["unavailable"] == (
        "the CUDA driver cannot start: cuInit failed: CUDA_ERROR_NO_DEVICE"
    )
    assert result["auto"] == "host"


@needs_gcc
def test_a_full_device_refuses_pages_and_a_pool_cannot_start(tmp_path: Path) -> None:
    result = run_child(build_stub(tmp_path / "full", "-DFULL_DEVICE"))
    assert result["granularity"] == 2**21
    assert result["free"] == 3 * 2**30
    assert result["reserved"] == "0x7f0000000000"
    assert result["create"] == "CUDA device 0 has no memory for a page of 2097152 bytes"
    assert result["pool"] == "CUDA device 1 has no memory for a page of 2097152 bytes"
    assert result["device5"] == (
        "CUDA device 5 is not usable: cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE"
    )


AUTO_CHILD = r"""
import json
from kvshare.runtime.backends import open_backend
from kvshare.runtime.errors import BackendUnavailableError

try:
    backend = open_backend("auto")
except BackendUnavailableError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    print(json.dumps({"backend": backend.name}))
"""


def run_auto(environ: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", AUTO_CHILD],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def gpu_container(**extra: str) -> dict[str, str]:
    """The environment of a container the device plugin gave a GPU (no KVSHARE_BACKEND)."""
    environ = {k: v for k, v in os.environ.items() if k != "KVSHARE_BACKEND"}
    environ.update({"KVSHARE_GPU_UUIDS": "GPU-1111", "CUDA_VISIBLE_DEVICES": "0", **extra})
    return environ


def test_auto_refuses_host_memory_where_an_older_cuda_package_shadows_cuda_python(
    tmp_path: Path,
) -> None:
    shadow = tmp_path / "site" / "cuda"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('__version__ = "11.8.0"\n')  # cuda-python 11's layout
    environ = gpu_container(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")]))
    refusal = run_auto(environ)["refused"]
    assert "this container has GPUs (KVSHARE_GPU_UUIDS=GPU-1111; CUDA_VISIBLE_DEVICES=0)" in refusal
    assert "cuda-python is not installed" in refusal  # why the cuda backend cannot start
    assert f"module cuda from {shadow} without cuda.bindings" in refusal  # what was found
    assert "cuda-python 13." in refusal and "cuda-bindings 13." in refusal  # which versions
    assert "set KVSHARE_BACKEND=host" in refusal


@needs_gcc
def test_auto_refuses_host_memory_where_the_driver_cannot_start(tmp_path: Path) -> None:
    stub = build_stub(tmp_path / "nodevice")
    refusal = run_auto(gpu_container(LD_LIBRARY_PATH=str(stub)))["refused"]
    assert "cuInit failed: CUDA_ERROR_NO_DEVICE" in refusal
    assert "driver for CUDA 13.0" in refusal  # the driver's own version, asked of libcuda


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed"
)
def test_auto_takes_host_memory_only_where_no_gpu_is_there() -> None:
    environ = gpu_container(CUDA_VISIBLE_DEVICES="")
    del environ["KVSHARE_GPU_UUIDS"]
    assert run_auto(environ) == {"backend": "host"}
    assert "refused" in run_auto(gpu_container())  # the same machine, a GPU allocated
