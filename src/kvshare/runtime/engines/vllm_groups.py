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
from collections.abc import Callable, Iterator
from typing import Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.pools import EngineConfigError, Role

__all__ = [
    "ENGINE",
    "Group",
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


#: Set while vLLM builds a worker's KV cache (``Worker.initialize_from_config``).
_worker: contextvars.ContextVar[tuple[Group, Role]] = contextvars.ContextVar("kvshare_vllm_worker")
#: Set while vLLM builds its scheduler (``Scheduler.__init__``): the group and KV layout.
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
def worker_context(group: Group, rank: int) -> Iterator[None]:
    """While set, ``allocate_kv_cache`` serves rank ``rank`` of ``group``."""
    token = _worker.set((group, Role(ENGINE, rank, group.world_size, "coordinated")))
    try:
        yield
    finally:
        _worker.reset(token)


@contextlib.contextmanager
def scheduler_context(group: Group, layout: Any) -> Iterator[None]:
    """While set, a KV cache coordinator draws its blocks from ``group``'s owner pool."""
    token = _scheduler.set((group, layout))
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


def current_worker() -> tuple[Group, Role] | None:
    """The group and role of the worker whose KV cache vLLM is building now, if any."""
    return _worker.get(None)


def current_scheduler() -> tuple[Group, Any] | None:
    """The group (and KV layout) of the scheduler vLLM is building now, if any."""
    return _scheduler.get(None)
