"""The node's GPUs: from NVML on a GPU node, or a declared fake inventory for the host
backend (``--fake-gpus 2x80Gi``), demos and tests.

An inventory answers three questions: which GPUs are there (UUID, index, name, total
memory), which are healthy right now, and how much device memory each process holds on
a GPU (the audit's view of the truth; the host backend audits memfds instead, see
:mod:`kvshare.deviceplugin.broker.audit`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from kvshare.api.quantity import QuantityError, format_bytes, parse_bytes

__all__ = [
    "FakeInventory",
    "GpuInfo",
    "Inventory",
    "InventoryError",
    "NvmlInventory",
    "open_inventory",
    "parse_fake_gpus",
]

log = logging.getLogger(__name__)

Backend = Literal["cuda", "host"]


class InventoryError(RuntimeError):
    """The GPUs cannot be discovered; the message says what to do instead."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the node agent knows it."""

    uuid: str
    index: int
    name: str
    total_bytes: int
    healthy: bool = True


class Inventory(Protocol):
    """What the node agent needs from a source of GPUs."""

    backend: Backend

    def gpus(self) -> list[GpuInfo]:
        """Every GPU with its current health, in index order."""

    def process_memory(self, gpu_uuid: str) -> Mapping[int, int] | None:
        """Device bytes held per pid on one GPU, or None when the device cannot tell."""

    def close(self) -> None:
        """Release the device library."""


_FAKE_PART = re.compile(r"^\s*(?:(\d+)\s*[xX]\s*)?(\S+?)\s*$")


#: The smallest fake GPU: room for a few pages of a demo's pools (the trace suite runs
#: scaled-down GPUs, see ``kvshare.demo.suite``).
_FAKE_GPU_MIN = 256 * 2**20


def parse_fake_gpus(spec: str, node: str = "") -> list[GpuInfo]:
    """GPUs declared as ``COUNTxSIZE[,COUNTxSIZE...]`` (``2x80Gi``, ``1x16Gi,1x40Gi``).

    UUIDs are derived from ``node`` and the index, so they stay the same across agent
    restarts (pools re-declare their leases by GPU UUID).
    """
    gpus: list[GpuInfo] = []
    for part in spec.split(","):
        match = _FAKE_PART.match(part)
        if not part.strip() or match is None:
            raise InventoryError(f"--fake-gpus {spec!r}: expected COUNTxSIZE, e.g. 2x80Gi")
        count = int(match.group(1) or 1)
        try:
            size = parse_bytes(match.group(2), field="--fake-gpus")
        except QuantityError as exc:
            raise InventoryError(f"--fake-gpus {spec!r}: {exc}") from None
        if count < 1 or count > 64 or size < _FAKE_GPU_MIN:
            raise InventoryError(
                f"--fake-gpus {spec!r}: each part needs 1-64 GPUs of at least 256Mi"
            )
        for _ in range(count):
            index = len(gpus)
            fake_uuid = uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"kvshare-fake-gpu:{node}:{index}")
            gpus.append(
                GpuInfo(
                    uuid=f"GPU-{fake_uuid}",
                    index=index,
                    name=f"kvshare fake GPU ({format_bytes(size)}, host memory)",
                    total_bytes=size,
                )
            )
    if len(gpus) > 64:
        raise InventoryError(f"--fake-gpus {spec!r}: at most 64 GPUs per node")
    return gpus


class FakeInventory:
    """Declared GPUs backed by host memory; health can be changed (for tests and demos)."""

    backend: Backend = "host"

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._lock = threading.Lock()  # guards _gpus
        self._gpus = list(gpus)

    def gpus(self) -> list[GpuInfo]:
        """The declared GPUs."""
        with self._lock:
            return list(self._gpus)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        """Mark a GPU healthy or not (the device plugin reports it in ListAndWatch)."""
        with self._lock:
            for i, gpu in enumerate(self._gpus):
                if gpu.uuid == gpu_uuid:
                    self._gpus[i] = replace(gpu, healthy=healthy)
                    return
        raise KeyError(gpu_uuid)

    def process_memory(self, gpu_uuid: str) -> Mapping[int, int] | None:
        """Host memory is audited through the pools' memfds, not through a device."""
        del gpu_uuid
        return None

    def close(self) -> None:
        """Nothing to release."""


# XIDs that report an application's own fault, not a broken GPU (the same list the
# NVIDIA device plugin skips): they must not mark the device unhealthy.
_APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class NvmlInventory:
    """GPUs from NVML (``nvidia-ml-py``).

    Health: a GPU turns unhealthy when NVML can no longer query it (lost, fallen off the
    bus) or reports a critical XID event that is not an application fault. It stays
    unhealthy until the agent restarts, as with NVIDIA's device plugin.
    """

    backend: Backend = "cuda"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a node dependency
            raise InventoryError(
                f"nvidia-ml-py is not installed ({exc}): install kvshare[node], or run "
                "without GPUs with --fake-gpus 1x16Gi (host backend)"
            ) from None
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise InventoryError(
                f"NVML is not available ({exc}): no NVIDIA driver is visible to the node "
                "agent. On a GPU node, run the agent with the NVIDIA container runtime; "
                "without GPUs, declare a fake inventory with --fake-gpus 1x16Gi "
                "(host backend)"
            ) from None
        self._lock = threading.Lock()  # guards _unhealthy and NVML event polling
        self._handles: dict[str, Any] = {}
        self._static: list[GpuInfo] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu_uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            self._handles[gpu_uuid] = handle
            self._static.append(
                GpuInfo(
                    uuid=gpu_uuid,
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        if not self._static:
            raise InventoryError(
                "NVML reports no GPUs on this node; without GPUs use --fake-gpus 1x16Gi"
            )
        self._unhealthy: set[str] = set()
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for handle in self._handles.values():
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, self._events
                )
        except pynvml.NVMLError as exc:
            log.warning("NVML XID events unavailable (%s): health from device queries only", exc)
            self._events = None

    def gpus(self) -> list[GpuInfo]:
        """The GPUs with their health as of now."""
        nvml = self._nvml
        with self._lock:
            self._drain_events()
            for gpu in self._static:
                if gpu.uuid in self._unhealthy:
                    continue
                try:
                    nvml.nvmlDeviceGetMemoryInfo(self._handles[gpu.uuid])
                except nvml.NVMLError as exc:
                    log.error("GPU %s (%s) cannot be queried: %s", gpu.index, gpu.uuid, exc)
                    self._unhealthy.add(gpu.uuid)
            return [replace(g, healthy=g.uuid not in self._unhealthy) for g in self._static]

    def _drain_events(self) -> None:
        nvml = self._nvml
        if self._events is None:
            return
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            except nvml.NVMLError as exc:
                log.warning("NVML event wait failed: %s", exc)
                return
            xid = int(event.eventData)
            if xid in _APPLICATION_XIDS:
                continue
            gpu_uuid = _text(nvml.nvmlDeviceGetUUID(event.device))
            log.error("GPU %s reported critical XID %d: marking it unhealthy", gpu_uuid, xid)
            self._unhealthy.add(gpu_uuid)

    def process_memory(self, gpu_uuid: str) -> Mapping[int, int] | None:
        """Device bytes per pid on ``gpu_uuid`` (compute processes), None if unknown."""
        nvml = self._nvml
        handle = self._handles.get(gpu_uuid)
        if handle is None:
            return None
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError as exc:
            log.debug("per-process memory of %s unavailable: %s", gpu_uuid, exc)
            return None
        held: dict[int, int] = {}
        for process in processes:
            used = process.usedGpuMemory
            if used is not None:
                held[int(process.pid)] = held.get(int(process.pid), 0) + int(used)
        return held

    def close(self) -> None:
        """Shut NVML down."""
        nvml = self._nvml
        with self._lock:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
                self._events = None
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_inventory(fake_gpus: str | None, node: str) -> Inventory:
    """The fake inventory when ``fake_gpus`` is given, else NVML (or a clear error)."""
    if fake_gpus:
        return FakeInventory(parse_fake_gpus(fake_gpus, node))
    return NvmlInventory()
