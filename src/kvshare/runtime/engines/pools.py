"""What every engine hook needs from the runtime: a pool on the worker's own device, the
KV capacity to announce, and the GPU's start-up turn.

Engine modules call these functions and nothing else of the runtime, so the engine
patches stay about the engine. Pools opened here are kept in a per-process table, so the
engine's scheduler (which sizes and allocates) finds the pool its worker's tensors live
in when both run in one process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvshare.api import env

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.pool import KVPool

log = logging.getLogger(__name__)

__all__ = [
    "EngineConfigError",
    "PoolIdentity",
    "device_index",
    "find_pool",
    "open_pool",
    "page_size",
    "startup_turn",
    "virtual_kv_bytes",
]

OwnershipMode = Literal["local", "coordinated"]


class EngineConfigError(RuntimeError):
    """The engine's configuration cannot be served by kvshare; the message says what to set."""


@dataclass(frozen=True)
class PoolIdentity:
    """Who a pool belongs to: reported to the broker, used for metrics and listeners."""

    engine: str
    rank: int
    world_size: int
    ownership: OwnershipMode


_lock = threading.Lock()  # guards _pools
_pools: dict[int, KVPool] = {}  # device index -> the pool of this process on that device


def device_index(device: torch.device | str | int) -> int:
    """The explicit index of ``device``; an implicit ``cuda`` is resolved now, on the calling
    thread, and never again: a pool's device must not follow whatever device a later
    (background) thread happens to have current."""
    import torch

    resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if resolved.index is not None:
        return resolved.index
    if resolved.type == "cuda":
        return torch.cuda.current_device()
    return 0


def page_size() -> int:
    """The pool's physical page size (``KVSHARE_PAGE_SIZE``)."""
    return env.PAGE_SIZE.require()


def virtual_kv_bytes(device: torch.device | str) -> int:
    """The KV capacity the engine should size its cache for: the pool's virtual size.

    ``KVSHARE_KV_MAX`` when set; otherwise the device's total memory less this worker's
    static footprint (``KVSHARE_STATIC_BYTES``). Never the device's *free* memory, which
    co-located servers change under each other. Physical use is bounded by the lease.
    """
    kv_max = env.KV_MAX.read()
    if kv_max is not None:
        return kv_max
    import torch

    target = torch.device(device)
    if target.type != "cuda":
        raise EngineConfigError(
            f"the KV cache on {target} has no device memory to size it from; set "
            "KVSHARE_KV_MAX to the largest KV cache (in bytes) this worker may grow to"
        )
    _, total = torch.cuda.mem_get_info(device_index(target))
    static = env.STATIC_BYTES.require()
    if total <= static:
        raise EngineConfigError(
            f"KVSHARE_STATIC_BYTES ({static}) is not below the device's memory ({total}); "
            "set it to this worker's weights, activations and CUDA context"
        )
    return total - static


def _open_lease(identity: PoolIdentity, device: int) -> object:
    from kvshare.runtime.leases import lease_from_env

    return lease_from_env(
        engine=identity.engine,
        rank=identity.rank,
        tp_size=identity.world_size,
        device=device,
    )


def open_pool(geometry: KVGeometry, device: torch.device | str, identity: PoolIdentity) -> KVPool:
    """Open this process's pool on ``device`` (explicit index) and remember it.

    The backend comes from ``KVSHARE_BACKEND``, the lease from the broker (or
    ``KVSHARE_KV_LIMIT``), the ownership from ``identity`` (local: page operations never
    leave this process; the TP size is still reported).
    """
    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.ownership import LocalOwnership
    from kvshare.runtime.pool import KVPool

    index = device_index(device)
    backend = open_backend(env.BACKEND.require(), index)
    try:
        lease = _open_lease(identity, index)
    except BaseException:
        backend.close()
        raise
    pool = KVPool(
        geometry,
        backend,
        lease,  # type: ignore[arg-type]
        LocalOwnership(identity.rank, identity.world_size),
        reserve_pages=env.RESERVE_PAGES.require(),
    )
    with _lock:
        previous = _pools.get(index)
        _pools[index] = pool
    if previous is not None:
        previous.close()
    log.info(
        "kvshare pool for %s rank %d/%d on device %d: %d blocks of %d bytes x %d buffers",
        identity.engine,
        identity.rank,
        identity.world_size,
        index,
        geometry.num_blocks,
        geometry.block_bytes,
        geometry.num_buffers,
    )
    return pool


def find_pool(num_blocks: int) -> KVPool | None:
    """The pool of this process whose geometry has ``num_blocks`` blocks, if any."""
    with _lock:
        pools = list(_pools.values())
    matches = [pool for pool in pools if pool.geometry.num_blocks == num_blocks]
    return matches[0] if len(matches) == 1 else None


def forget_pools() -> None:
    """Close and forget every pool of this process (engine shutdown, tests)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


@contextlib.contextmanager
def startup_turn(engine: str, device: torch.device | str) -> Iterator[None]:
    """Hold the GPU's start-up turn from the broker while the engine profiles memory."""
    from kvshare.runtime.broker_client import startup_turn as broker_turn

    with broker_turn(engine=engine, device=device_index(device)):
        yield
