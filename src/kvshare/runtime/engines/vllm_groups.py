"""A vLLM engine's coordinated group, and which part of it is building its KV cache now.

One engine core (its scheduler) and its tensor-parallel workers form a coordinated group
(DESIGN §2), named after vLLM's instance id and data-parallel rank. vLLM builds its KV
cache in two places that cannot tell which engine they belong to by themselves: the
workers' ``allocate_kv_cache`` and the scheduler's KV cache coordinator. kvshare's hooks
of ``Worker.initialize_from_config`` and ``Scheduler.__init__`` set the context around
them (:func:`worker_context`, :func:`scheduler_context`); the worker also holds its GPU's
start-up turn until its KV cache exists (:func:`hold_startup_turn`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.pools import EngineConfigError, Role

__all__ = [
    "ENGINE",
    "Group",
    "WorkerContext",
    "close_startup_turn",
    "current_scheduler",
    "current_worker",
    "group_of",
    "hold_startup_turn",
    "scheduler_context",
    "tp_rank",
    "worker_context",
]

ENGINE = "vllm"


@dataclasses.dataclass(frozen=True)
class Group:
    """A coordinated group: one vLLM engine core and its tensor-parallel workers."""

    name: str
    world_size: int


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """A worker building its KV cache: its group and rank, and what its attention backends
    accept (to tell why its pool pages per layer)."""

    group: Group
    role: Role
    supported_layouts: tuple[str, ...] = ()
    """Layouts every attention backend of the worker supports, most preferred first."""
    backends: str = ""
    """Those backends and their layouts, in vLLM's words (for the log)."""


#: Set while vLLM builds a worker's KV cache (``Worker.initialize_from_config``).
_worker: contextvars.ContextVar[WorkerContext] = contextvars.ContextVar("kvshare_vllm_worker")
#: Set while vLLM builds its scheduler (``Scheduler.__init__``): the group and the cache
#: config, whose KV layout the engine core has resolved by the time it builds one.
_scheduler: contextvars.ContextVar[tuple[Group, Any]] = contextvars.ContextVar(
    "kvshare_vllm_scheduler"
)


def group_of(vllm_config: Any) -> Group:
    """The group of one engine core: named after vLLM's instance id and data-parallel rank."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise EngineConfigError(
            f"kvshare serves vLLM with pipeline-parallel size 1, not "
            f"{parallel.pipeline_parallel_size}"
        )
    instance = re.sub(r"[^A-Za-z0-9._-]", "-", str(vllm_config.instance_id))[:32] or "engine"
    name = f"vllm-{instance}-dp{parallel.data_parallel_rank}"
    return Group(name, int(parallel.tensor_parallel_size))


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM's parallel state exists)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


@contextlib.contextmanager
def worker_context(
    group: Group, rank: int, supported_layouts: Sequence[str] = (), backends: str = ""
) -> Iterator[None]:
    """While set, ``allocate_kv_cache`` serves rank ``rank`` of ``group``, whose attention
    backends (``backends``) support ``supported_layouts``."""
    role = Role(ENGINE, rank, group.world_size, "coordinated")
    token = _worker.set(WorkerContext(group, role, tuple(supported_layouts), backends))
    try:
        yield
    finally:
        _worker.reset(token)


@contextlib.contextmanager
def scheduler_context(group: Group, cache_config: Any) -> Iterator[None]:
    """While set, a KV cache coordinator draws its blocks from ``group``'s owner pool;
    ``cache_config`` is the scheduler's (its KV layout is read only when a pool is
    attached: a scheduler built outside the engine core may have none resolved)."""
    token = _scheduler.set((group, cache_config))
    try:
        yield
    finally:
        _scheduler.reset(token)


_TURN_ATTRIBUTE = "_kvshare_startup_turn"


def hold_startup_turn(
    worker: Any, vllm_config: Any, local_rank: int, start: Callable[[], object]
) -> None:
    """Take the GPU's start-up turn, then run ``start``; the worker holds the turn until
    its KV cache exists (:func:`close_startup_turn`), or gives it back if ``start`` fails."""
    group = group_of(vllm_config)
    turn = contextlib.ExitStack()
    role = Role(ENGINE, int(local_rank), group.world_size, "coordinated")
    turn.enter_context(pools.startup_turn(role, group.name))
    setattr(worker, _TURN_ATTRIBUTE, turn)
    try:
        start()
    except BaseException:
        turn.close()
        raise


def close_startup_turn(worker: Any) -> None:
    """Give back the start-up turn ``worker`` holds, if it still holds one."""
    turn = getattr(worker, _TURN_ATTRIBUTE, None)
    if turn is not None:
        setattr(worker, _TURN_ATTRIBUTE, None)
        turn.close()


def current_worker() -> WorkerContext | None:
    """The worker whose KV cache vLLM is building now, if any."""
    return _worker.get(None)


def current_scheduler() -> tuple[Group, Any] | None:
    """The group and cache config of the scheduler vLLM is building now, if any."""
    return _scheduler.get(None)
