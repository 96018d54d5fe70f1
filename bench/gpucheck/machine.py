"""Where the GPU check runs: the machine, what it lacks, and the :class:`Setup` of a run."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
GIB = 2**30


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check on a GPU, or None when it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    try:
        import torch
    except ImportError:
        return None  # the driver is there; the missing package is reported next
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


def missing_packages(dry_run: bool) -> list[str]:
    """Python distributions the check needs that are not importable."""
    needed = {"torch": "torch", "numpy": "numpy", "pytest": "pytest"}
    needed |= {"prometheus_client": "prometheus-client", "grpc": "grpcio"}
    needed |= {"pydantic": "pydantic", "yaml": "pyyaml"}
    if not dry_run:
        needed |= {"cuda.bindings": "cuda-python", "pynvml": "nvidia-ml-py"}
    missing = []
    for module, dist in needed.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(dist)
    if not ensure_kubelet_stubs():
        missing.append("grpcio-tools (or copy the stubs `make proto` writes)")
    return missing


def ensure_kubelet_stubs() -> bool:
    """Whether the node agent's generated kubelet API stubs are there (made if they can be)."""
    kubelet = ROOT / "src" / "kvshare" / "deviceplugin" / "kubelet"
    stubs = [kubelet / "v1beta1" / "api_pb2.py", kubelet / "podresources" / "v1" / "api_pb2.py"]
    if all(s.exists() for s in stubs):
        return True
    if importlib.util.find_spec("grpc_tools") is None:
        return False
    from kvshare.deviceplugin.kubelet.protogen import generate

    generate()
    return all(s.exists() for s in stubs)


@dataclass(frozen=True)
class Setup:
    """Where the steps run: the ``cuda`` backend on GPU 0, or ``host`` in a dry run."""

    dry_run: bool

    @property
    def backend(self) -> str:
        return "host" if self.dry_run else "cuda"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.dry_run else "cuda:0"

    def describe(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {
            "mode": "dry-run" if self.dry_run else "gpu",
            "backend": self.backend,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        if not self.dry_run:
            props = torch.cuda.get_device_properties(0)
            info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GIB, 1)}
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlInit()
                info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        return info

    def synchronize(self) -> None:
        if not self.dry_run:
            import torch

            torch.cuda.synchronize()

    def device_free(self) -> int | None:
        """Free memory of the device, or None in a dry run (host memory is too noisy)."""
        if self.dry_run:
            return None
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        return int(free)
