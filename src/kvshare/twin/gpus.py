"""The GPU kinds the twin knows: memory, bandwidth and compute, and vLLM's defaults on each.

The numbers are AIConfigurator's system specs (``aiconfigurator-core``
``systems/<gpu>.yaml``), copied into ``data/gpus.json`` by ``tools/tabulate_steps.py``;
the twin reads only that file. Each kind's name is AIConfigurator's (``h200_sxm``,
``h100_sxm``, ``a100_sxm``, ``l40s``, ``b200_sxm``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = [
    "GPU_MEMORY_UTILIZATION",
    "GpuKind",
    "UnknownGpuError",
    "gpu_kind",
    "gpu_kinds",
]

GIB = 2**30
#: The share of a GPU's memory vLLM's processes may use together: vLLM's default
#: ``gpu_memory_utilization`` (0.92 in ``vllm/config/cache.py`` of vLLM 0.33). Static
#: partitions split it between the servers; the rest is left to the driver and the
#: processes' own CUDA contexts. The twin holds every world to the same share: what the
#: broker never lends (its headroom) is the same 8 %.
GPU_MEMORY_UTILIZATION = 0.92


class UnknownGpuError(ValueError):
    """A GPU kind the twin has no data for."""


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind (see the module doc for where each number comes from)."""

    name: str
    memory_bytes: int
    #: Peak memory bandwidth, bytes per second.
    memory_bandwidth: float
    #: Peak dense bf16 tensor-core throughput, FLOP per second.
    bf16_flops: float
    #: What one engine process keeps for NCCL at each tensor-parallel size, bytes.
    nccl_bytes: dict[int, int]
    #: What one engine process keeps for the CUDA context, cuBLAS workspaces and CUDA
    #: graphs (AIConfigurator's ``other_mem``, 3.5 GiB on every kind: "for safer
    #: deployment, this will cover part of the inaccurate memory calculation").
    other_bytes: int
    source: str

    @property
    def usable_bytes(self) -> int:
        """What the engines on the GPU may use together (:data:`GPU_MEMORY_UTILIZATION`)."""
        return int(self.memory_bytes * GPU_MEMORY_UTILIZATION)

    @property
    def vllm_max_batched_tokens(self) -> int:
        """vLLM's default ``max_num_batched_tokens`` for its OpenAI server on this GPU."""
        return self._vllm_defaults()[0]

    @property
    def vllm_max_seqs(self) -> int:
        """vLLM's default ``max_num_seqs`` for its OpenAI server on this GPU."""
        return self._vllm_defaults()[1]

    def _vllm_defaults(self) -> tuple[int, int]:
        # vllm/engine/arg_utils.py (vLLM 0.33), EngineArgs.get_batch_defaults for
        # UsageContext.OPENAI_API_SERVER: 16384 tokens and 1024 sequences on GPUs of 160 GiB
        # or more (B200); 8192 and 1024 from 70 GiB, A100s excepted (H100, H200); 2048 and
        # 256 otherwise (A100, L40S). The memory is the device's total, as torch reports it.
        if self.memory_bytes >= 160 * GIB:
            return 16384, 1024
        if self.memory_bytes >= 70 * GIB and "a100" not in self.name:
            return 8192, 1024
        return 2048, 256


@functools.cache
def gpu_kinds() -> dict[str, GpuKind]:
    """Every GPU kind of ``data/gpus.json``, by name."""
    raw: dict[str, Any] = json.loads(
        resources.files("kvshare.twin").joinpath("data", "gpus.json").read_text("utf-8")
    )
    return {
        name: GpuKind(
            name=name,
            memory_bytes=int(spec["memory_bytes"]),
            memory_bandwidth=float(spec["memory_bandwidth"]),
            bf16_flops=float(spec["bf16_flops"]),
            nccl_bytes={int(k): int(v) for k, v in spec["nccl_bytes"].items()},
            other_bytes=int(spec["other_bytes"]),
            source=str(spec["source"]),
        )
        for name, spec in raw["gpus"].items()
    }


def gpu_kind(name: str) -> GpuKind:
    """The GPU kind called ``name``; an unknown one is refused with the known ones."""
    kinds = gpu_kinds()
    if name not in kinds:
        raise UnknownGpuError(
            f"the twin knows no GPU kind {name!r}; known: {', '.join(sorted(kinds))}"
        )
    return kinds[name]
