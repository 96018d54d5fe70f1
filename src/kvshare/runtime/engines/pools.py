"""What every engine hook needs from the runtime: pools on the worker's own device, the KV
capacity to announce, and the GPU's start-up turn.

Engine modules call these functions and nothing else of the runtime, so the engine
patches stay about the engine. Two shapes of pool (DESIGN §2):

- :func:`open_local_pool` — a rank that owns its pages (SGLang: one scheduler per rank).
- :func:`open_rank` + :func:`open_owner_pool` — a coordinated group (vLLM): every worker
  serves its device's memory through a :class:`~kvshare.runtime.rank_server.RankServer`,
  and the scheduler's pool (no memory of its own) maps the same pages on all of them.

Devices are always explicit indices, resolved on the engine's own thread when the pool is
opened (see :func:`device_index`); leases come from the broker, or ``KVSHARE_KV_LIMIT``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from kvshare.api import env

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.backends import Backend, BackendKind
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.lease import LeaseSource
    from kvshare.runtime.paging import Paging
    from kvshare.runtime.pool import KVPool
    from kvshare.runtime.rank_server import RankServer

log = logging.getLogger(__name__)

__all__ = [
    "EngineConfigError",
    "Role",
    "begin_startup_turn",
    "device_index",
    "end_startup_turn",
    "forget_pools",
    "lease_for",
    "mark_launched",
    "open_local_pool",
    "open_owner_pool",
    "open_rank",
    "page_size",
    "startup_budget",
    "startup_turn",
    "virtual_kv_bytes",
]


class EngineConfigError(RuntimeError):
    """The engine's configuration cannot be served by kvshare; the message says what to set."""


@dataclass(frozen=True)
class Role:
    """Where a pool sits in the engine: its tensor-parallel rank and who owns the pages."""

    engine: str
    rank: int
    world_size: int
    ownership: Literal["local", "coordinated"]


_lock = threading.Lock()  # guards _opened, _held_turn and _gpu_totals
_opened: list[KVPool | RankServer] = []  # closed by forget_pools (engine shutdown, tests)
_held_turn: contextlib.ExitStack | None = None  # begin_startup_turn .. end_startup_turn
#: GPU UUID -> its memory, as the broker's start-up turn stated it (the node agent's inventory).
_gpu_totals: dict[str, int] = {}


def device_index(device: torch.device | str) -> int:
    """The explicit index of ``device``. An implicit ``cuda`` is resolved now, on the calling
    (engine) thread, and never again: a pool's device must not follow whatever device a later
    background thread happens to have current."""
    import torch

    resolved = torch.device(device)
    index = cast("int | None", resolved.index)  # None for an implicit "cuda"
    if index is not None:
        return index
    if resolved.type == "cuda":
        return int(torch.cuda.current_device())
    return 0


def page_size() -> int:
    """The pool's physical page size (``KVSHARE_PAGE_SIZE``)."""
    return env.PAGE_SIZE.require()


def virtual_kv_bytes(device: torch.device | str, rank: int = 0) -> int:
    """The KV capacity the engine sizes its cache for: the pool's virtual size.

    ``KVSHARE_KV_CAPACITY`` when set (the operator sets it from the GPU, so that
    ``kvCache.max`` can be raised in place), else ``KVSHARE_KV_MAX``; otherwise the GPU's
    total memory less this worker's static footprint (``KVSHARE_STATIC_BYTES``), the total
    read from the CUDA device, or for a pool without one (the ``host`` backend) from the
    node agent's inventory as the broker's start-up turn stated it; standalone, without a
    node agent, the fixed lease (``KVSHARE_KV_LIMIT``), which the pool never maps beyond.
    Never the device's *free* memory, which co-located servers change under each other.
    Physical use is bounded by the lease.
    """
    sized = env.KV_CAPACITY.read()
    if sized is None:
        sized = env.KV_MAX.read()
    if sized is not None:
        return sized
    import torch

    target = torch.device(device)
    if target.type == "cuda":
        _, total = torch.cuda.mem_get_info(device_index(target))
        return _less_static(int(total), "the device's memory")
    total = _granted_gpu_total(rank)
    if total:
        return _less_static(total, "the GPU's memory in the node agent's inventory")
    limit = env.KV_LIMIT.read()
    if limit is not None:
        return limit
    raise EngineConfigError(
        f"a KV cache on {target} has no device memory to be sized from and no node agent "
        "stated its GPU's memory; set KVSHARE_KV_CAPACITY (or KVSHARE_KV_MAX) to the largest "
        "KV cache (bytes) this worker may grow to"
    )


def _less_static(total: int, what: str) -> int:
    static = env.STATIC_BYTES.require()
    if total <= static:
        raise EngineConfigError(
            f"KVSHARE_STATIC_BYTES ({static}) is not below {what} ({total}); "
            "set it to this worker's weights, activations and CUDA context"
        )
    return total - static


def _granted_gpu_total(rank: int) -> int:
    """The memory of ``rank``'s GPU stated by a start-up turn of this process, or 0."""
    from kvshare.runtime.leases import gpu_for_rank

    if not env.GPU_UUIDS.read():
        return 0
    with _lock:
        return _gpu_totals.get(gpu_for_rank(rank), 0)


def _lease_chunk() -> int:
    from kvshare.runtime.pool_lease import DEFAULT_LEASE_CHUNK_BYTES

    chunk = env.LEASE_CHUNK.read()
    return DEFAULT_LEASE_CHUNK_BYTES if chunk is None else chunk


def startup_budget() -> int:
    """Device memory kvshare grants this worker at start-up: its static footprint
    (``KVSHARE_STATIC_BYTES``) plus the KV memory it can count on — its ``kv min`` under the
    broker (what its start-up turn reserves), or its fixed ``KVSHARE_KV_LIMIT`` standalone.

    What an engine's own start-up check of free memory should ask for on a shared GPU,
    instead of a fraction of the device's total.
    """
    from kvshare.runtime.broker_client import broker_present, broker_socket_path

    static = env.STATIC_BYTES.require()
    if broker_present(broker_socket_path()):
        return static + env.KV_MIN.require()
    return static + (env.KV_LIMIT.read() or 0)


def _backend_kind() -> BackendKind:
    return cast("BackendKind", env.BACKEND.require())


def lease_for(role: Role) -> LeaseSource:
    """The lease of a pool or rank in ``role``: the broker's, or ``KVSHARE_KV_LIMIT``."""
    from kvshare.runtime.leases import lease_from_env

    return lease_from_env(rank=role.rank, tp_size=role.world_size, engine=role.engine)


def _remember(opened: KVPool | RankServer) -> None:
    with _lock:
        _opened.append(opened)


def _memory(device: torch.device | str, role: Role) -> tuple[int, Backend, LeaseSource]:
    """This worker's device index, a backend on that device, and its lease."""
    from kvshare.runtime.backends import open_backend

    index = device_index(device)
    backend = open_backend(_backend_kind(), index)
    try:
        return index, backend, lease_for(role)
    except BaseException:
        backend.close()
        raise


def open_local_pool(
    geometry: KVGeometry,
    device: torch.device | str,
    role: Role,
    *,
    agreed: bool = False,
    paging: Paging | None = None,
) -> KVPool:
    """A pool whose page operations never leave this process; the TP size is still reported.

    With ``agreed``, the pool's limit is what the rank's group agrees on at each step
    (:class:`~kvshare.runtime.engines.group_lease.AgreedLease`); ``paging`` says what its
    pages hold (reported to the node agent).
    """
    from kvshare.runtime.engines.group_lease import AgreedLease
    from kvshare.runtime.ownership import LocalOwnership
    from kvshare.runtime.pool import KVPool

    index, backend, lease = _memory(device, role)
    if agreed:
        lease = AgreedLease(lease)
    pool = KVPool(
        geometry,
        backend,
        lease,
        LocalOwnership(role.rank, role.world_size),
        reserve_pages=env.RESERVE_PAGES.read(),
        lease_chunk_bytes=_lease_chunk(),
        paging=paging,
    )
    _remember(pool)
    log.info(
        "kvshare pool of %s rank %d/%d on device %d: %d blocks of %d bytes x %d buffers",
        role.engine,
        role.rank,
        role.world_size,
        index,
        geometry.num_blocks,
        geometry.block_bytes,
        geometry.num_buffers,
    )
    return pool


def open_rank(
    geometry: KVGeometry,
    device: torch.device | str,
    role: Role,
    group: str,
    *,
    paging: Paging | None = None,
) -> RankServer:
    """Serve this worker's device memory to its group's owner (tensors: ``.tensor``);
    ``paging`` says what its pages hold (reported to the node agent)."""
    from kvshare.runtime.rank_server import RankServer

    _, backend, lease = _memory(device, role)
    server = RankServer(
        geometry,
        backend,
        lease,
        group=group,
        rank=role.rank,
        world_size=role.world_size,
        paging=paging,
    )
    _remember(server)
    return server


def open_owner_pool(geometry: KVGeometry, group: str, world_size: int) -> KVPool:
    """The pool that decides for a coordinated group; every rank maps what it maps."""
    from kvshare.runtime.coordinated import CoordinatedOwnership
    from kvshare.runtime.pool import KVPool

    ownership = CoordinatedOwnership(group, world_size)
    try:
        pool = KVPool(
            geometry,
            None,
            ownership.group_lease(),
            ownership,
            reserve_pages=env.RESERVE_PAGES.read(),
            lease_chunk_bytes=_lease_chunk(),
        )
    except BaseException:
        ownership.close()
        raise
    _remember(pool)
    return pool


def mark_launched(device: torch.device | str, streams: Sequence[object] = ()) -> None:
    """The engine has launched a step's device work: every pool and rank of this process
    marks its device fence on the current stream and ``streams`` (torch streams), so no
    page is unmapped before that work is done (:mod:`kvshare.runtime.fence`). Once a step."""
    import torch

    handles: tuple[int, ...] = (0,)
    if torch.device(device).type == "cuda":
        current = torch.cuda.current_stream(torch.device(device))
        found = (current, *streams)
        handles = tuple(sorted({int(s.cuda_stream) for s in found if s is not None}))  # type: ignore[attr-defined]
    with _lock:
        backends = [item.backend for item in _opened if item.backend is not None]
    for backend in backends:
        backend.record_fence(handles)


def forget_pools() -> None:
    """Close every pool and rank server this process opened, and forget the GPU memory
    start-up turns stated (engine shutdown, tests)."""
    with _lock:
        opened = list(reversed(_opened))
        _opened.clear()
        _gpu_totals.clear()
    for item in opened:
        item.close()


@contextlib.contextmanager
def startup_turn(role: Role, group: str = "") -> Iterator[None]:
    """Hold the GPU's start-up turn from the broker while the engine profiles memory.

    The ranks of a tensor-parallel group name their ``group`` (unique within the pod): the
    broker gives them their turns together. Without a node agent (``KVSHARE_KV_LIMIT``
    standalone use) there is no turn to take.
    """
    from kvshare.runtime.broker_client import (
        PoolIdentity,
        broker_present,
        broker_socket_path,
    )
    from kvshare.runtime.broker_client import (
        startup_turn as broker_turn,
    )
    from kvshare.runtime.leases import gpu_for_rank

    if not broker_present(broker_socket_path()):
        log.debug("no kvshare broker: %s rank %d starts without a turn", role.engine, role.rank)
        yield
        return
    identity = PoolIdentity.from_env(rank=role.rank, tp_size=role.world_size, engine=role.engine)
    gpu = gpu_for_rank(role.rank)
    with broker_turn(
        gpu,
        static_bytes=env.STATIC_BYTES.require(),
        kv_min=env.KV_MIN.require(),
        identity=identity,
        group="/".join(part for part in (identity.pod_uid, group or role.engine) if part),
    ) as granted:
        if granted.gpu_total > 0:
            with _lock:
                _gpu_totals[gpu] = granted.gpu_total
        yield


def begin_startup_turn(role: Role, group: str = "") -> None:
    """Take the GPU's start-up turn for this process until :func:`end_startup_turn` — for an
    engine whose start-up spans several of its functions (SGLang: one scheduler per
    process, from loading its weights to building its KV buffers)."""
    global _held_turn
    turn = contextlib.ExitStack()
    turn.enter_context(startup_turn(role, group))
    with _lock:
        previous, _held_turn = _held_turn, turn
    if previous is not None:
        previous.close()


def end_startup_turn() -> None:
    """Give back the turn :func:`begin_startup_turn` took, if it is still held."""
    global _held_turn
    with _lock:
        turn, _held_turn = _held_turn, None
    if turn is not None:
        turn.close()
