"""One CUDA GPU's device layer, standing in on a CPU machine, for vLLM's GPU worker.

Only what a GPU driver and runtime answer is replaced; vLLM's own code runs:

- vLLM's platform (its device abstraction, :class:`FakeCudaPlatform`): device type
  ``cuda``, one device, ``gloo`` for collectives in place of NCCL;
- ``torch.accelerator``'s device and memory queries: the memory figures of :class:`Gpu`
  (a total, and what other processes hold);
- CUDA streams and events: no-ops (nothing runs asynchronously on a CPU);
- CUDA tensors: placed in host memory, unpinned (:class:`HostTensors`).

:func:`install` must run before anything imports vLLM's worker modules (they bind the
platform when imported), so it is used by child processes (``start_worker.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """The memory figures the device layer reports."""

    total: int
    held_by_others: int

    @property
    def free(self) -> int:
        return self.total - self.held_by_others


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _Event()


def _is_cuda(device: Any) -> bool:
    return isinstance(device, str | torch.device) and torch.device(device).type == "cuda"


class HostTensors(TorchFunctionMode):
    """CUDA tensors live in host memory; pinning is a no-op."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.pin_memory, torch.Tensor.cuda):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(arg) else arg for arg in args)
            kwargs.pop("non_blocking", None)
        return func(*args, **kwargs)


def _platform_class(gpu: Gpu) -> type:
    from vllm.platforms.interface import Platform, PlatformEnum

    class FakeCudaPlatform(Platform):
        """vLLM's view of one CUDA GPU (an out-of-tree platform, so no CUDA kernels load)."""

        _enum = PlatformEnum.OOT
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"
        dist_backend = "gloo"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        @classmethod
        def logical_device_id_to_visible_device_id(cls, index: int) -> int:
            return index

        @classmethod
        def check_if_supports_dtype(cls, dtype: Any) -> None:
            pass

        def is_cuda_alike(self) -> bool:
            return True  # a CUDA device: vLLM takes its CUDA (and ROCm) paths

        @classmethod
        def current_device(cls) -> int:
            return 0

        @classmethod
        def manual_seed_all(cls, seed: int) -> None:
            torch.manual_seed(seed)

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return False

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return gpu.total

    return FakeCudaPlatform


def install(gpu: Gpu) -> None:
    """Make this process's vLLM and torch see ``gpu`` (call before importing vLLM's worker)."""
    import vllm.platforms

    accelerator: Any = torch.accelerator
    accelerator.device_count = lambda: 1
    accelerator.set_device_index = lambda device: None
    accelerator.current_device_index = lambda: 0
    accelerator.empty_cache = lambda: None
    accelerator.synchronize = lambda device=None: None
    accelerator.memory_stats = lambda device=None: {}
    accelerator.memory_reserved = lambda device=None: 0
    accelerator.get_memory_info = lambda device=None: (gpu.free, gpu.total)
    cuda: Any = torch.cuda
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.mem_get_info = lambda device=None: (gpu.free, gpu.total)
    vllm.platforms._current_platform = _platform_class(gpu)()  # type: ignore[attr-defined]
    # A GPU machine has Triton: vLLM 0.34's GPU worker refuses to start without it (its
    # only model runner, V2, compiles Triton kernels, none of which runs before the KV
    # cache exists). Only the worker's own check is told so; the modules that would load
    # Triton's kernels keep their stand-ins.
    from vllm.v1.worker import gpu_worker

    gpu_worker.HAS_TRITON = True


@contextlib.contextmanager
def host_tensors() -> Iterator[None]:
    """While set, tensors vLLM puts on the GPU are made in host memory."""
    with HostTensors():
        yield
