"""The machine a workload's engines share, as the twin's worlds see it.

A :class:`Device` says how much memory the engines have, what each model keeps beside
its KV cache, what a step of each model costs alone, how the engines spread over the
device's compute, and how kvshare's pools page its memory. Two kinds exist:

- :class:`GpuDevice`: one GPU of a named kind (:mod:`kvshare.twin.gpus`), its step times
  from AIConfigurator's tables (:mod:`kvshare.twin.steps`), every engine on its one
  compute unit;
- :class:`~kvshare.twin.cpu.CpuDevice`: the CPU machine the ``elastic-vllm`` benchmark
  runs real ``vllm serve`` on, with its step cost measured there
  (``tools/calibrate_step_cost.py``), the engines pinned to its cores as the demo pins
  them. Named ``cpu-<MiB>mib`` (the KV memory of the demo's fake GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvshare.demo.engine_api import SchedulerLimits
from kvshare.demo.step_cost import CostModel, StepWork
from kvshare.runtime.pool_lease import DEFAULT_LEASE_CHUNK_BYTES
from kvshare.twin import cpu
from kvshare.twin.arbiter import roofline_demand
from kvshare.twin.gpus import GpuKind, gpu_kind
from kvshare.twin.models import Footprint, footprint
from kvshare.twin.pages import GRANULE
from kvshare.twin.steps import TableStepCost, load_table
from kvshare.twin.workload import ModelSpec

__all__ = ["Demand", "Device", "GpuDevice", "device_named"]

#: The share of its compute unit's binding resource a step uses alone, from its work and
#: its alone time (see :mod:`kvshare.twin.arbiter`'s MPS model).
Demand = Callable[[StepWork, float], float]


class Device(Protocol):
    """What the worlds need of the machine (see the module doc)."""

    @property
    def name(self) -> str:
        """The device's name, as a workload gives it."""

    @property
    def memory_bytes(self) -> int:
        """The device's memory."""

    @property
    def usable_bytes(self) -> int:
        """What the engines may use together (weights, runtime memory and KV caches)."""

    @property
    def compute_units(self) -> int:
        """Compute units the engines are pinned to: model ``m`` runs on unit
        ``m % compute_units``, and only engines of one unit share its compute."""

    @property
    def page_granule(self) -> int:
        """The pools' mapping granularity, bytes per buffer."""

    @property
    def lease_chunk_bytes(self) -> int:
        """The step a pool's lease grows in (rounded to whole logical pages)."""

    def limits(self) -> SchedulerLimits:
        """Each engine's scheduler limits."""

    def footprint(self, spec: ModelSpec) -> Footprint:
        """What ``spec``'s server keeps on the device beside its KV cache."""

    def cost(self, spec: ModelSpec) -> CostModel:
        """What a step of ``spec``'s engine costs with its compute unit to itself."""

    def demand(self, item: Footprint) -> Demand:
        """A step's demand on its compute unit (MPS-style sharing)."""


@dataclass(frozen=True)
class GpuDevice:
    """One GPU of a named kind (see the module doc)."""

    kind: GpuKind

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def memory_bytes(self) -> int:
        return self.kind.memory_bytes

    @property
    def usable_bytes(self) -> int:
        return self.kind.usable_bytes

    @property
    def compute_units(self) -> int:
        return 1

    @property
    def page_granule(self) -> int:
        return GRANULE

    @property
    def lease_chunk_bytes(self) -> int:
        return DEFAULT_LEASE_CHUNK_BYTES

    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(
            max_tokens=self.kind.vllm_max_batched_tokens,
            max_running=self.kind.vllm_max_seqs,
            chunked_prefill=True,
        )

    def footprint(self, spec: ModelSpec) -> Footprint:
        return footprint(spec, self.kind)

    def cost(self, spec: ModelSpec) -> CostModel:
        return TableStepCost(
            load_table(self.kind.name, spec.architecture, spec.engine, spec.tensor_parallel)
        )

    def demand(self, item: Footprint) -> Demand:
        return roofline_demand(item, self.kind)


def device_named(name: str) -> Device:
    """The device a workload names: ``cpu-<MiB>mib`` (:mod:`kvshare.twin.cpu`) or a GPU
    kind (:func:`~kvshare.twin.gpus.gpu_kind`; an unknown one is refused)."""
    if cpu.is_cpu_name(name):
        return cpu.cpu_device(name)
    return GpuDevice(gpu_kind(name))
