"""The two resources the device plugin advertises, as ids, preferences and allocations.

- ``kvshare.io/gpu``: each GPU advertises ``slots_per_gpu`` slot ids ``<uuid>::<n>``. A
  replica with tensor-parallel size k requests k slots and must get them on k distinct
  GPUs.
- ``kvshare.io/gpu-memory``: one id ``<uuid>::mem<n>`` per GiB a GPU can lend (total less
  headroom), so the scheduler and ResourceQuota can account GPU memory per node and per
  namespace. Which unit a container gets carries no meaning.

Preferred allocation (``kvshare.io/gpu``), in order:
1. the GPUs the operator planned for the oldest pending pod on this node whose request
   matches (its ``kvshare.io/gpus`` annotation), when a pod lookup is configured and one
   fits the available slots and the must-include ids;
2. otherwise the shared placement function (:mod:`kvshare.api.placement`) with the
   ``spread`` policy over the GPUs with an available slot (most free memory first), as
   nothing is known of the pod's memory needs;
3. otherwise (fewer distinct GPUs than requested) any available slots, so the answer
   always has exactly the requested size. Allocate then refuses slots that share a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvshare.api import env, names
from kvshare.api.placement import GpuState, NodeState, Placement, ReplicaRequest, place
from kvshare.deviceplugin.inventory import GpuInfo

__all__ = [
    "AllocationError",
    "ContainerAllocation",
    "PlannedGpus",
    "allocate",
    "memory_unit_ids",
    "preferred_slots",
    "slot_ids",
    "split_id",
]

_SEPARATOR = "::"

#: Given (allocation size, GPUs with an available slot, GPUs that must be included), the
#: planned GPUs of a pending pod that fit, or None.
PlannedGpus = Callable[[int, frozenset[str], frozenset[str]], tuple[str, ...] | None]


class AllocationError(ValueError):
    """An allocation the plugin cannot honour; the message says why."""


def slot_ids(gpu: GpuInfo, per_gpu: int) -> list[str]:
    """The ``kvshare.io/gpu`` ids of one GPU."""
    return [f"{gpu.uuid}{_SEPARATOR}{n}" for n in range(per_gpu)]


def memory_unit_ids(gpu: GpuInfo, headroom: int) -> list[str]:
    """The ``kvshare.io/gpu-memory`` ids of one GPU: one per whole GiB it can lend."""
    units = max(gpu.total_bytes - headroom, 0) // names.GPU_MEMORY_UNIT_BYTES
    return [f"{gpu.uuid}{_SEPARATOR}mem{n}" for n in range(units)]


def split_id(device_id: str) -> tuple[str, str]:
    """``(gpu uuid, local part)`` of a device id; ValueError for a foreign id."""
    uuid, sep, local = device_id.rpartition(_SEPARATOR)
    if not sep or not uuid or not local:
        raise AllocationError(f"{device_id!r} is not a kvshare device id (<gpu-uuid>::<n>)")
    return uuid, local


def _slot_order(device_id: str) -> tuple[str, int, str]:
    uuid, local = split_id(device_id)
    return (uuid, int(local) if local.isdigit() else 1 << 30, local)


def preferred_slots(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpus: Mapping[str, GpuInfo],
    free_bytes: Mapping[str, int],
    *,
    planned: PlannedGpus | None = None,
) -> list[str]:
    """Exactly ``size`` ids from ``available``, including ``must_include`` (see module doc)."""
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) >= size:
        return chosen[:size] if size > 0 else []
    taken = set(chosen)
    by_gpu: dict[str, list[str]] = {}
    for device_id in sorted(set(available) - taken, key=_slot_order):
        uuid, _ = split_id(device_id)
        if uuid in gpus:
            by_gpu.setdefault(uuid, []).append(device_id)
    used_gpus = {split_id(d)[0] for d in chosen}
    need = size - len(chosen)
    open_gpus = frozenset(u for u in by_gpu if u not in used_gpus and gpus[u].healthy)

    plan = (
        planned(size, open_gpus | frozenset(used_gpus), frozenset(used_gpus)) if planned else None
    )
    if plan is not None:
        extra = [u for u in plan if u not in used_gpus]
        if len(extra) == need and all(u in open_gpus for u in extra):
            return chosen + [by_gpu[u][0] for u in extra]

    picked = _place(need, open_gpus, by_gpu, gpus, free_bytes)
    for uuid in picked:
        chosen.append(by_gpu[uuid].pop(0))
    if len(chosen) < size:
        rest = [d for ids in by_gpu.values() for d in ids]
        chosen += sorted(rest, key=_slot_order)[: size - len(chosen)]
    return chosen


def _place(
    need: int,
    open_gpus: frozenset[str],
    by_gpu: Mapping[str, list[str]],
    gpus: Mapping[str, GpuInfo],
    free_bytes: Mapping[str, int],
) -> tuple[str, ...]:
    if need <= 0 or len(open_gpus) < need:
        return ()
    node = NodeState(
        name="local",
        gpus=tuple(
            GpuState(
                uuid=u,
                index=gpus[u].index,
                free_bytes=free_bytes.get(u, 0),
                free_slots=len(by_gpu[u]),
            )
            for u in open_gpus
        ),
    )
    request = ReplicaRequest(key="container", group="", per_gpu_bytes=0, tp=need, policy="spread")
    result = place([request], [node])["container"]
    return result.gpus if isinstance(result, Placement) else ()


@dataclass(frozen=True)
class ContainerAllocation:
    """What a container gets for its slots (mirrors ContainerAllocateResponse)."""

    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]
    """(container path, host path, read only)."""
    cdi_devices: list[str]


def allocate(
    device_ids: Iterable[str],
    gpus: Mapping[str, GpuInfo],
    *,
    backend: str,
    run_dir: str,
    broker_socket_name: str,
    cdi_kind: str | None = None,
) -> ContainerAllocation:
    """The environment, mounts and CDI devices for a container given these slots."""
    ids = list(device_ids)
    uuids: list[str] = []
    for device_id in ids:
        uuid, _ = split_id(device_id)
        if uuid not in gpus:
            raise AllocationError(f"{device_id!r} names a GPU this node does not have")
        if uuid in uuids:
            raise AllocationError(
                f"slots {', '.join(ids)} put two ranks on GPU {uuid}: a container's "
                f"{names.RESOURCE_GPU} slots must be on distinct GPUs"
            )
        uuids.append(uuid)
    uuids.sort(key=lambda u: gpus[u].index)
    listed = ",".join(uuids)
    envs = {
        env.GPU_UUIDS.name: listed,
        env.BROKER_SOCKET.name: f"{names.RUN_DIR}/{broker_socket_name}",
    }
    cdi_devices: list[str] = []
    if backend == "host":
        envs[env.BACKEND.name] = "host"
    elif cdi_kind:
        cdi_devices = [f"{cdi_kind}={u}" for u in uuids]
        envs["CUDA_VISIBLE_DEVICES"] = listed
    else:
        envs["NVIDIA_VISIBLE_DEVICES"] = listed
        envs["CUDA_VISIBLE_DEVICES"] = listed
    return ContainerAllocation(
        envs=envs,
        mounts=[(names.RUN_DIR, run_dir, True)],
        cdi_devices=cdi_devices,
    )
