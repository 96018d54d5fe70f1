"""vLLM hooks shared by every supported vLLM line. The line modules say where they apply.

What changes in vLLM:

- **Capacity** (``Worker.determine_available_memory``): the engine sizes its KV cache
  from the pool's virtual size, by setting vLLM's own ``kv_cache_memory_bytes`` before
  its profiling runs (the profile run still compiles the model). The device's free
  memory no longer matters.
- **Start-up memory check** (``request_memory``, called by ``Worker.init_device``): vLLM
  refuses to start unless the device's free memory covers ``gpu_memory_utilization`` of
  its total, which a GPU shared with another engine never has. The check asks instead for
  what kvshare grants this worker: its static footprint plus its KV minimum (or fixed
  limit), and fails with kvshare's numbers when even that is not free.
- **Start-up turn** (``Worker.init_device`` to ``Worker.initialize_from_config``): each
  worker holds its GPU's turn from the broker while vLLM checks free memory, loads
  weights, profiles and allocates its KV cache, so engines starting on one GPU do not
  measure each other.
- **Tensors** (``allocate_kv_cache`` where the model runners call it): one
  :class:`~kvshare.runtime.pool.KVPool` per worker, on the worker's own device, whose
  geometry mirrors vLLM's layout: layer-outer layouts get one pool buffer per layer,
  block-outer layouts one buffer of packed blocks. vLLM's own
  ``create_kv_cache_views`` builds the per-layer views over the pool's range.
- **Blocks** (``KVCacheCoordinator.__init__`` and the scheduler steps): the scheduler's
  ``BlockPool`` draws its block ids from the pool (:mod:`.vllm_blocks`); exhaustion makes
  ``allocate_slots`` return ``None`` and the scheduler preempts or waits.
- **Fences** (``Scheduler.schedule``/``update_from_output``, ``Worker.execute_model``/
  ``sample_tokens``): a page freed while steps are in flight is unmapped only once their
  output is back (the scheduler's step fence) and, on every rank, once the work launched
  on its own device is done (its device fence; :mod:`kvshare.runtime.fence`).

Tensor parallelism uses *coordinated* ownership: each worker serves its device's memory
through a rank server (``Worker.initialize_from_config`` names the group after vLLM's
instance id and data-parallel rank), and the scheduler's pool, which holds no memory
itself, maps every page on all ranks before it hands out a block (``Scheduler.__init__``
names the same group). With one worker in the scheduler's process the group has one rank.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.patching import AnyCallable, Deferred, Patch, PatchSet, Target
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.engines.vllm_blocks import (
    attach,
    finishing_a_step,
    resetting_through_pool,
    scheduling_a_step,
    signalling_shortfall,
    usage_of_held_memory,
)
from kvshare.runtime.engines.vllm_groups import (
    ENGINE,
    Group,
    close_startup_turn,
    current_scheduler,
    group_of,
    hold_startup_turn,
    scheduler_context,
    tp_rank,
    worker_context,
)
from kvshare.runtime.engines.vllm_layout import asking_for_block_outer, worker_layout_facts
from kvshare.runtime.engines.vllm_tensors import (
    KernelBlockSize,
    PoolPlan,
    allocating_from_pool,
    group_kernel_block_size,
    plan_pool,
)

log = logging.getLogger(__name__)

__all__ = [
    "ALLOCATE_SLOTS_PARAMETERS",
    "BLOCK_POOL_PARAMETERS",
    "COORDINATOR_PARAMETERS",
    "ENGINE",
    "EngineConfigError",
    "Group",
    "PoolPlan",
    "group_kernel_block_size",
    "group_of",
    "hold_startup_turn",
    "plan_pool",
    "scheduler_context",
    "vllm_patch_set",
    "worker_context",
]


def taking_the_startup_turn(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.init_device``: the GPU's start-up turn is held from here (vLLM
    checks free memory first, then loads weights and profiles) until the KV cache exists."""

    def init_device(self: Any) -> None:
        hold_startup_turn(self, self.vllm_config, self.local_rank, lambda: original(self))

    return init_device


def checking_the_grant(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``request_memory``: vLLM's free-memory check at start-up, against what
    kvshare grants this worker instead of ``gpu_memory_utilization`` of the device."""

    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any) -> int:
        total = int(init_snapshot.total_memory)
        budget = pools.startup_budget()
        if budget > total:
            raise EngineConfigError(
                f"kvshare grants this worker {_gib(budget)} GiB (static footprint and KV "
                f"minimum) but device {init_snapshot.device_} has {_gib(total)} GiB in all; "
                "lower KVSHARE_STATIC_BYTES or the KV minimum"
            )
        granted = copy.copy(cache_config)
        granted.gpu_memory_utilization = max(budget, 1) / total
        try:
            return original(init_snapshot, granted, *args)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise EngineConfigError(
                f"device {init_snapshot.device_} has {_gib(init_snapshot.free_memory)} GiB "
                f"free, less than the {_gib(budget)} GiB kvshare grants this worker (static "
                "footprint and KV minimum): memory the broker does not account for is in "
                f"use on this GPU, or KVSHARE_STATIC_BYTES is too high (vLLM: {exc})"
            ) from exc

    return request_memory


def marking_the_device_fence(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.execute_model`` and ``Worker.sample_tokens``: once the step's
    work is launched, this worker's rank marks its device fence on the current stream."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        pools.mark_launched(self.device)
        return result

    return step


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f}"


def in_worker_group(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.initialize_from_config``: the worker's KV cache joins its group;
    the start-up turn ends once it exists."""

    def initialize_from_config(self: Any, kv_cache_config: Any) -> None:
        try:
            supported, backends = worker_layout_facts(self)
            with worker_context(group_of(self.vllm_config), tp_rank(), supported, backends):
                original(self, kv_cache_config)
        finally:
            close_startup_turn(self)

    return initialize_from_config


def in_scheduler_group(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Scheduler.__init__``: its block pool becomes the group's owner."""

    def init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        # The KV layout is read only if a pool is attached (attaching_block_pool): a
        # scheduler built outside the engine core may not have one resolved.
        with scheduler_context(group_of(vllm_config), vllm_config.cache_config):
            original(self, vllm_config, *args, **kwargs)

    return init


# --- worker: capacity -----------------------------------------------------------------


def sizing_from_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``Worker.determine_available_memory``: the pool's virtual size."""

    def determine_available_memory(self: Any) -> int:
        # vLLM's own "KV cache of this many bytes" setting: its profiling still runs (and
        # compiles the model) but no longer derives the size from free memory.
        self.cache_config.kv_cache_memory_bytes = pools.virtual_kv_bytes(self.device)
        return original(self)  # type: ignore[no-any-return]

    return determine_available_memory


def attaching_block_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``KVCacheCoordinator.__init__``: its block pool draws from the group."""

    def init(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, kv_cache_config, *args, **kwargs)
        if not kv_cache_config.kv_cache_tensors:
            return  # an attention-free model: no KV cache to page
        context = current_scheduler()
        if context is None:
            raise EngineConfigError(
                "vLLM built a KV cache coordinator outside its scheduler; kvshare cannot tell "
                "which engine's workers hold the memory"
            )
        group, cache_config = context
        plan = plan_pool(kv_cache_config, _resolved_layout(kv_cache_config, cache_config))
        attach(self.block_pool, pools.open_owner_pool(plan.geometry, group.name, group.world_size))

    return init


def _resolved_layout(kv_cache_config: Any, cache_config: Any) -> Any:
    """The KV layout the engine core resolved: the KV cache config's, else the cache
    config's. Without either the workers' layout is unknown and the pool cannot mirror it."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = kv_cache_config.kv_cache_layout or cache_config.kv_cache_layout
    if name is None:
        raise EngineConfigError(
            "vLLM built a scheduler with a KV cache but no resolved KV cache layout; kvshare "
            "cannot tell how the workers lay it out (resolve it first, as vLLM's engine core "
            "does)"
        )
    return KVCacheLayout[name]


# --- the patch list -------------------------------------------------------------------

_WORKER = "vllm.v1.worker"
_CORE = "vllm.v1.core"
#: ``allocate_kv_cache``'s parameters up to 0.33 (0.34 adds ``allocate``).
ALLOCATE_PARAMETERS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
#: Where the model runners reach ``allocate_kv_cache`` up to 0.33: the V1 runner's module
#: and the V2 runner's ``gpu.attn_utils``.
ALLOCATORS = tuple(
    Target(module, "allocate_kv_cache", ALLOCATE_PARAMETERS)
    for module in (f"{_WORKER}.gpu_model_runner", f"{_WORKER}.gpu.attn_utils")
)
#: ``request_memory``'s parameters since 0.32 (0.30.x has no external weight memory).
REQUEST_MEMORY_PARAMETERS = ("init_snapshot", "cache_config", "external_weight_memory")
#: Constructor parameters every supported line shares; lines append their own.
COORDINATOR_PARAMETERS = (
    "self",
    "kv_cache_config",
    "max_model_len",
    "max_in_flight_tokens",
    "use_eagle",
    "enable_caching",
    "enable_kv_cache_events",
    "dcp_world_size",
    "pcp_world_size",
    "scheduler_block_size",
    "hash_block_size",
    "metrics_collector",
    "num_prefill_lookahead",
)
#: ``KVCacheManager.allocate_slots`` parameters every supported line shares.
ALLOCATE_SLOTS_PARAMETERS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_computed_tokens",
    "new_computed_blocks",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "delay_cache_blocks",
    "num_encoder_tokens",
    "full_sequence_must_fit",
    "reserved_blocks",
    "has_scheduled_reqs",
)
BLOCK_POOL_PARAMETERS = (
    "self",
    "num_gpu_blocks",
    "enable_caching",
    "hash_block_size",
    "enable_kv_cache_events",
    "metrics_collector",
)
_SCHEDULER_INIT = (
    "self",
    "vllm_config",
    "kv_cache_config",
    "structured_output_manager",
    "block_size",
    "hash_block_size",
    "mm_registry",
    "include_finished_set",
    "log_stats",
)


def vllm_patch_set(
    line: str,
    *,
    coordinator_parameters: tuple[str, ...],
    block_pool_parameters: tuple[str, ...],
    kernel_block_size: KernelBlockSize,
    allocate_slots_parameters: tuple[str, ...],
    deferred: tuple[Deferred, ...] = (),
    request_memory_parameters: tuple[str, ...] = REQUEST_MEMORY_PARAMETERS,
    allocators: tuple[Target, ...] = ALLOCATORS,
    free_blocks_parameters: tuple[str, ...] = ("self", "ordered_blocks"),
    extra: tuple[Patch, ...] = (),
) -> PatchSet:
    """The patches of one vLLM line. The lines keep most targets in the same places; they
    differ in constructor and ``allocate_slots`` parameters, in where and how the model
    runner allocates the KV cache (``allocators``) and chooses a tensor's kernel block
    size. ``deferred``: sets applied when vLLM imports their module (its CPU worker);
    ``extra``: patches only this line needs."""
    block_pool = f"{_CORE}.block_pool"
    scheduler = f"{_CORE}.sched.scheduler"
    patches = [
        Patch(
            Target(
                "vllm.v1.engine.core",
                "resolve_kv_cache_layout",
                ("vllm_config", "supported_layouts", "kv_cache_specs"),
            ),
            asking_for_block_outer,
            "the engine core prefers a block-outer KV layout where every backend supports one",
        ),
        Patch(
            Target(f"{_WORKER}.gpu_worker", "Worker.init_device", ("self",)),
            taking_the_startup_turn,
            "the worker holds its GPU's start-up turn until its KV cache exists",
        ),
        Patch(
            Target(f"{_WORKER}.gpu_worker", "request_memory", request_memory_parameters),
            checking_the_grant,
            "the start-up free-memory check asks for what kvshare grants this worker",
        ),
        Patch(
            Target(f"{_WORKER}.gpu_worker", "Worker.determine_available_memory", ("self",)),
            sizing_from_pool,
            "KV capacity from the pool's virtual size, not free memory",
        ),
        *(
            Patch(
                target,
                allocating_from_pool(kernel_block_size),
                "KV cache tensors over the pool's reserved range",
            )
            for target in allocators
        ),
        Patch(
            Target(
                f"{_WORKER}.gpu_worker",
                "Worker.initialize_from_config",
                ("self", "kv_cache_config"),
            ),
            in_worker_group,
            "the worker's KV cache is a rank of its engine's coordinated group; turn ends",
        ),
        Patch(
            Target(f"{_CORE}.sched.scheduler", "Scheduler.__init__", _SCHEDULER_INIT),
            in_scheduler_group,
            "the scheduler's block pool owns its engine's coordinated group",
        ),
        Patch(
            Target(
                f"{_CORE}.kv_cache_coordinator",
                "KVCacheCoordinator.__init__",
                coordinator_parameters,
            ),
            attaching_block_pool,
            "the scheduler's block ids come from the pool",
        ),
        *(
            Patch(
                Target(scheduler, f"Scheduler.{name}", parameters),
                wrap,
                "the pool evicts, lowers its lease and counts steps between scheduler steps",
            )
            for name, parameters, wrap in (
                ("schedule", ("self", "throttle_prefills"), scheduling_a_step),
                (
                    "update_from_output",
                    ("self", "scheduler_output", "model_runner_output"),
                    finishing_a_step,
                ),
            )
        ),
        *(
            Patch(
                Target(f"{_WORKER}.gpu_worker", f"Worker.{name}", ("self", parameter)),
                marking_the_device_fence,
                "a launched step marks the worker's device fence: no unmap before it is done",
            )
            for name, parameter in (
                ("execute_model", "scheduler_output"),
                ("sample_tokens", "grammar_output"),
            )
        ),
        Patch(
            Target(
                f"{_CORE}.kv_cache_manager",
                "KVCacheManager.allocate_slots",
                allocate_slots_parameters,
            ),
            signalling_shortfall,
            "a request held back for want of free blocks asks the pool for more lease",
        ),
        Patch(
            Target(block_pool, "BlockPool.reset_prefix_cache", ("self",)),
            resetting_through_pool,
            "a prefix-cache reset gives the cached blocks back to the pool",
        ),
        Patch(
            Target(block_pool, "BlockPool.get_usage", ("self",)),
            usage_of_held_memory,
            "KV usage relative to what the pool can hold now",
        ),
        *extra,
    ]
    requires = [
        Target(block_pool, "BlockPool.__init__", block_pool_parameters),
        Target(block_pool, "BlockPool.get_new_blocks", ("self", "num_blocks")),
        Target(block_pool, "BlockPool.free_blocks", free_blocks_parameters),
        Target(block_pool, "BlockPool.touch", ("self", "blocks")),
        Target(block_pool, "BlockPool._maybe_evict_cached_block", ("self", "block")),
        Target(block_pool, "BlockPool._notify_reuse", ("self", "blocks")),
        Target(f"{_CORE}.kv_cache_utils", "FreeKVCacheBlockQueue.__init__", ("self", "blocks")),
        Target(
            "vllm.v1.kv_cache_interface",
            "create_kv_cache_views",
            ("raw", "spec", "num_blocks", "layout", "kv_cache_tensor", "kernel_block_size"),
        ),
        Target(
            "vllm.distributed.kv_transfer.kv_connector.utils",
            "get_current_attn_backends",
            ("vllm_config", "layer_names"),
        ),
        Target(f"{_WORKER}.worker_base", "WorkerBase.get_supported_kv_cache_layouts", ("self",)),
    ]
    return PatchSet(ENGINE, line, patches, requires, deferred)
