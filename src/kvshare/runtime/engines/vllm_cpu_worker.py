"""vLLM's CPU worker, given the semantics kvshare gives the GPU worker.

vLLM's CPU build runs ``vllm.v1.worker.cpu_worker.CPUWorker``, a subclass of the GPU
``Worker`` that overrides ``__init__`` (it compares the host's free memory with
``--gpu-memory-utilization`` there), ``init_device`` and ``determine_available_memory``
without calling ``super()``: the GPU worker's patches of those never run on CPU. These
patches give the CPU worker what :mod:`.vllm_common` gives the GPU worker:

- **Start-up turn**: held from ``CPUWorker.__init__`` (before vLLM's free-memory check)
  until the KV cache exists (``Worker.initialize_from_config``, which the CPU worker
  inherits and :mod:`.vllm_common` patches).
- **Capacity**: the pool's virtual size (:func:`~.pools.virtual_kv_bytes`: the fake GPU's
  memory as the node agent states it, or ``KVSHARE_KV_MAX``, or a standalone fixed
  lease), set as vLLM's own explicit KV cache size before the worker is built, so no KV
  size is passed to vLLM by hand. ``determine_available_memory`` keeps vLLM's own warm-up
  decision but does not compare the virtual size with the host's free memory: the pool
  maps physical memory only within its lease, as on a GPU.
- **Tensors and blocks**: up to 0.33 ``CPUModelRunner`` reaches the GPU model runner's
  ``allocate_kv_cache``, patched with the GPU worker's; from 0.34 the CPU runner allocates
  in ``vllm.v1.worker.cpu.attn_utils``, patched here (``allocators``). The scheduler is the
  same.

Importing ``cpu_worker`` reconfigures torch for the CPU platform (``vllm.v1.worker.cpu.shm``
replaces ``torch.cuda.Event`` and more), so kvshare never imports it: this set is
:class:`~.patching.Deferred`, applied when vLLM itself imports the module — only on its
CPU platform.
"""

from __future__ import annotations

import logging
from typing import Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.patching import (
    AnyCallable,
    Deferred,
    Patch,
    PatchSet,
    Target,
    is_patched,
)
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.engines.vllm_groups import ENGINE, hold_startup_turn

__all__ = ["cpu_worker_patches"]

log = logging.getLogger(__name__)

MODULE = "vllm.v1.worker.cpu_worker"
_INIT = ("self", "vllm_config", "local_rank", "rank", "distributed_init_method", "is_driver_worker")


def taking_the_turn_and_sizing(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``CPUWorker.__init__``: take the turn, size the KV cache from the pool."""

    def init(self: Any, vllm_config: Any, local_rank: int, *args: Any, **kwargs: Any) -> None:
        if not is_patched(type(self).initialize_from_config):
            raise EngineConfigError(
                f"{type(self).__qualname__}.initialize_from_config is not kvshare's: the CPU "
                "worker would hold its start-up turn for ever; this vLLM build is not supported"
            )

        def start() -> None:
            # vLLM's own explicit size: its check of the host's free memory against
            # --gpu-memory-utilization (an automatic size) then does not apply.
            size = pools.virtual_kv_bytes("cpu", int(local_rank))
            vllm_config.cache_config.kv_cache_memory_bytes = size
            original(self, vllm_config, local_rank, *args, **kwargs)

        hold_startup_turn(self, vllm_config, local_rank, start)

    return init


def sizing_from_pool(original: AnyCallable) -> AnyCallable:
    """Replacement of ``CPUWorker.determine_available_memory``: vLLM's warm-up, then the
    pool's virtual size, which the original would refuse when it exceeds the host's free
    memory (the pool never maps more than its lease)."""
    del original  # replaced: it only warms up and compares the size with free memory

    def determine_available_memory(self: Any) -> int:
        size = pools.virtual_kv_bytes(self.device, int(self.local_rank))
        self.cache_config.kv_cache_memory_bytes = size
        if self._should_warm_up_model():
            self.model_runner.warming_up_model()
        log.info(
            "kvshare: vLLM's CPU worker sizes its KV cache for the pool's %d bytes; physical "
            "memory follows the lease",
            size,
        )
        return size

    return determine_available_memory


def cpu_worker_patches(
    line: str,
    *,
    runner_module: str = "vllm.v1.worker.cpu_model_runner",
    allocators: tuple[Patch, ...] = (),
) -> Deferred:
    """The CPU worker's patches of one vLLM line: the worker's own targets are the same
    in every line; its model runner lives in ``runner_module``, and ``allocators`` are the
    CPU runner's own KV allocation patches where it has one."""
    patches = [
        Patch(
            Target(MODULE, "CPUWorker.__init__", _INIT),
            taking_the_turn_and_sizing,
            "the CPU worker holds its GPU's start-up turn and sizes its KV cache from the pool",
        ),
        Patch(
            Target(MODULE, "CPUWorker.determine_available_memory", ("self",)),
            sizing_from_pool,
            "KV capacity from the pool's virtual size, not the host's free memory",
        ),
        *allocators,
    ]
    requires = [
        Target(MODULE, "CPUWorker._should_warm_up_model", ("self",)),
        Target(MODULE, "CPUWorker.initialize_from_config", ("self", "kv_cache_config")),
        Target(runner_module, "CPUModelRunner.warming_up_model", ("self",)),
    ]
    return Deferred(MODULE, PatchSet(ENGINE, f"{line} CPU worker", patches, requires))
