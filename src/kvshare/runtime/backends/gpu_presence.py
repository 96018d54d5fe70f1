"""Whether this container was given GPUs, and which CUDA pieces it has: for ``auto``.

``KVSHARE_BACKEND=auto`` takes host memory only where there is no GPU. When GPUs are
allocated but the ``cuda`` backend cannot start (an image's own older ``cuda`` package
shadowing cuda-python, a driver older than the bindings), host memory would hand the
engine CPU tensors on a GPU node, which fails later and far from the cause. These
functions gather what the refusal names instead: the evidence of GPUs and the versions.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import importlib.util

from kvshare.api import env

__all__ = ["cuda_versions", "gpu_evidence"]

#: CUDA_VISIBLE_DEVICES values that mean "no GPU" (NVIDIA's container runtime uses some).
_NO_DEVICES = {"", "-1", "none", "void", "nodevfiles"}


def gpu_evidence(device_glob: str = "/dev/nvidia[0-9]*") -> list[str]:
    """What says this container has GPUs: kvshare's allocation, CUDA's visible devices,
    NVIDIA device files. Empty on a machine without GPUs."""
    found = []
    uuids = env.GPU_UUIDS.read()
    if uuids:
        found.append(f"KVSHARE_GPU_UUIDS={uuids}")
    visible = env.cuda_visible_devices()
    if visible is not None and visible.strip().lower() not in _NO_DEVICES:
        found.append(f"CUDA_VISIBLE_DEVICES={visible}")
    files = sorted(glob.glob(device_glob))
    if files:
        found.append(f"device files {', '.join(files)}")
    return found


def _distribution(name: str) -> str:
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} not installed"


def _cuda_module() -> str:
    """Where Python's ``cuda`` package comes from, and whether it has the bindings."""
    try:
        spec = importlib.util.find_spec("cuda")
    except (ImportError, ValueError) as exc:
        return f"module cuda cannot be found ({exc})"
    if spec is None:
        return "no module cuda"
    where = ", ".join(spec.submodule_search_locations or []) or str(spec.origin)
    try:
        bindings = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        bindings = False
    if bindings:
        return f"module cuda from {where}"
    return (
        f"module cuda from {where} without cuda.bindings "
        "(an older cuda package shadows cuda-python)"
    )


def _driver_version() -> str:
    """The NVIDIA driver's CUDA version, asked of libcuda directly (not through cuda-python)."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 cannot be loaded ({exc})"
    version = ctypes.c_int(0)
    try:
        code = library.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:
        return "libcuda.so.1 has no cuDriverGetVersion"
    if code != 0:
        return f"cuDriverGetVersion failed with code {code}"
    return f"driver for CUDA {version.value // 1000}.{version.value % 1000 // 10}"


def cuda_versions() -> str:
    """The CUDA pieces this process finds, in one phrase for an error message."""
    parts = [_distribution("cuda-python"), _distribution("cuda-bindings"), _cuda_module()]
    parts.append(_driver_version())
    return "; ".join(parts)
