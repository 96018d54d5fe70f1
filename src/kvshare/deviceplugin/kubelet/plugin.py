"""The kubelet-facing gRPC side of the device plugin: one ``DevicePlugin`` service per
resource, each on its own unix socket in the device-plugin directory.

The decisions (ids, preferences, allocations) live in :mod:`kvshare.deviceplugin.kubelet.slots`;
this module only translates between them and the kubelet API, as NVIDIA's plugin keeps
its server apart from its resource manager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvshare.api import names
from kvshare.deviceplugin.admin.metrics import NodeMetrics
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.deviceplugin.kubelet import slots
from kvshare.deviceplugin.kubelet.kubelet_api import HEALTHY, UNHEALTHY, pb, rpc

__all__ = [
    "DeviceWatch",
    "GpuMemoryResource",
    "GpuSlotResource",
    "PluginServer",
    "Resource",
]

log = logging.getLogger(__name__)


class DeviceWatch:
    """A version number that moves whenever a device's health may have changed;
    ``ListAndWatch`` streams wait on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards _version and _stopped
        self._version = 0
        self._stopped = False

    def bump(self) -> None:
        """Devices changed: every stream sends the list again."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def wait_past(self, version: int, timeout: float) -> int:
        """The current version once it is past ``version`` (or after ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > version or self._stopped, timeout)
            return self._version

    def stop(self) -> None:
        """Wake every stream for good (the plugin is stopping)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped


class Resource(Protocol):
    """One extended resource as the plugin serves it."""

    name: str
    endpoint: str
    preferred_available: bool

    def devices(self) -> list[tuple[str, bool]]:
        """``(id, healthy)`` of every device."""

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """A preferred allocation (only called when ``preferred_available``)."""

    def allocate(self, device_ids: list[str]) -> slots.ContainerAllocation:
        """What a container gets for these devices (AllocationError when it cannot)."""


@dataclass
class NodeView:
    """What the resources read about the node, each call fresh."""

    gpus: Callable[[], list[GpuInfo]]
    free_bytes: Callable[[], Mapping[str, int]]
    backend: str
    run_dir: str
    broker_socket_name: str
    cdi_kind: str | None = None
    planned: slots.PlannedGpus | None = None

    def by_uuid(self) -> dict[str, GpuInfo]:
        """The GPUs by UUID."""
        return {g.uuid: g for g in self.gpus()}


class GpuSlotResource:
    """``kvshare.io/gpu``: N slots per GPU."""

    name = names.RESOURCE_GPU
    endpoint = "kvshare-gpu.sock"
    preferred_available = True

    def __init__(self, node: NodeView, per_gpu: int) -> None:
        if per_gpu < 1:
            raise ValueError(f"slots per GPU must be >= 1, not {per_gpu}")
        self._node = node
        self._per_gpu = per_gpu

    def devices(self) -> list[tuple[str, bool]]:
        """Every slot, healthy when its GPU is."""
        return [(i, g.healthy) for g in self._node.gpus() for i in slots.slot_ids(g, self._per_gpu)]

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """k slots on k distinct GPUs (see :func:`slots.preferred_slots`)."""
        return slots.preferred_slots(
            available,
            must_include,
            size,
            self._node.by_uuid(),
            self._node.free_bytes(),
            planned=self._node.planned,
        )

    def allocate(self, device_ids: list[str]) -> slots.ContainerAllocation:
        """Visible GPUs, the broker socket mount and the KVSHARE_* environment."""
        node = self._node
        return slots.allocate(
            device_ids,
            node.by_uuid(),
            backend=node.backend,
            run_dir=node.run_dir,
            broker_socket_name=node.broker_socket_name,
            cdi_kind=node.cdi_kind,
        )


class GpuMemoryResource:
    """``kvshare.io/gpu-memory``: GiB units of lendable GPU memory on the node."""

    name = names.RESOURCE_GPU_MEMORY
    endpoint = "kvshare-gpu-memory.sock"
    preferred_available = False

    def __init__(self, node: NodeView, headroom: int) -> None:
        self._node = node
        self._headroom = headroom

    def devices(self) -> list[tuple[str, bool]]:
        """Every GiB unit, healthy when its GPU is."""
        return [
            (i, g.healthy)
            for g in self._node.gpus()
            for i in slots.memory_unit_ids(g, self._headroom)
        ]

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """Not offered (the kubelet picks any units)."""
        del available, must_include, size
        raise NotImplementedError

    def allocate(self, device_ids: list[str]) -> slots.ContainerAllocation:
        """Accounting only: nothing to inject."""
        known = self._node.by_uuid()
        for device_id in device_ids:
            if slots.split_id(device_id)[0] not in known:
                raise slots.AllocationError(f"{device_id!r} names a GPU this node does not have")
        return slots.ContainerAllocation(envs={}, mounts=[], cdi_devices=[])


class _Service:
    """The ``DevicePlugin`` gRPC service of one resource."""

    def __init__(
        self,
        resource: Resource,
        watch: DeviceWatch,
        metrics: NodeMetrics,
        on_stream_end: Callable[[float], None],
    ) -> None:
        self._resource = resource
        self._watch = watch
        self._metrics = metrics
        self._on_stream_end = on_stream_end

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Preferred allocation on for slots; no PreStartContainer."""
        del request, context
        return pb.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self._resource.preferred_available,
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        """The device list now and after every change, until the kubelet hangs up."""
        del request
        started = time.monotonic()
        version = -1
        sent: list[tuple[str, bool]] | None = None
        while context.is_active() and not self._watch.stopped:
            version = self._watch.wait_past(version, timeout=1.0)
            devices = self._resource.devices()
            if devices != sent:
                sent = devices
                yield pb.ListAndWatchResponse(
                    devices=[
                        pb.Device(ID=i, health=HEALTHY if ok else UNHEALTHY) for i, ok in devices
                    ]
                )
        if not self._watch.stopped:
            self._on_stream_end(started)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:  # noqa: N802
        """One preferred id list per container request."""
        responses = []
        try:
            for container in request.container_requests:
                ids = self._resource.preferred(
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    int(container.allocation_size),
                )
                responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        except (slots.AllocationError, NotImplementedError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc) or "not supported")
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: Any, context: Any) -> Any:  # noqa: N802
        """One ContainerAllocateResponse per container request."""
        start = time.perf_counter()
        name = self._resource.name
        responses = []
        try:
            for container in request.container_requests:
                allocation = self._resource.allocate(list(container.devices_ids))
                responses.append(
                    pb.ContainerAllocateResponse(
                        envs=allocation.envs,
                        mounts=[
                            pb.Mount(container_path=c, host_path=h, read_only=ro)
                            for c, h, ro in allocation.mounts
                        ],
                        cdi_devices=[pb.CDIDevice(name=n) for n in allocation.cdi_devices],
                    )
                )
        except slots.AllocationError as exc:
            self._metrics.allocations.labels(name, "refused").inc()
            log.warning("refused %s allocation: %s", name, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._metrics.allocations.labels(name, "ok").inc()
        self._metrics.allocate_seconds.labels(name).observe(time.perf_counter() - start)
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Nothing to prepare."""
        del request, context
        return pb.PreStartContainerResponse()


class PluginServer:
    """Serves one resource on ``<directory>/<endpoint>``; can be restarted after the
    kubelet deleted the socket."""

    def __init__(
        self,
        resource: Resource,
        directory: Path,
        watch: DeviceWatch,
        metrics: NodeMetrics,
        on_stream_end: Callable[[float], None],
    ) -> None:
        """``on_stream_end(started)`` is called when the kubelet ends a ListAndWatch
        stream that started at ``started`` (monotonic seconds)."""
        self.resource = resource
        self.path = directory / resource.endpoint
        self._service = _Service(resource, watch, metrics, on_stream_end)
        self._server: grpc.Server | None = None
        self._inode: int | None = None

    def start(self) -> None:
        """(Re)create the socket and serve on it."""
        self.stop()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # stale, from an earlier run
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvshare-plugin"),
            options=[("grpc.so_reuseport", 0)],
        )
        rpc.add_DevicePluginServicer_to_server(self._service, server)
        if not server.add_insecure_port(f"unix://{self.path}"):
            raise OSError(f"cannot serve the device plugin on {self.path}")
        server.start()
        self._server = server
        self._inode = os.stat(self.path).st_ino

    def serving(self) -> bool:
        """Whether our socket is still there (a starting kubelet deletes it)."""
        if self._server is None:
            return False
        try:
            return os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def stop(self) -> None:
        """Stop serving and remove our socket (if it is still ours)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=0.5).wait(2)
            if self._inode is not None:
                try:
                    if os.stat(self.path).st_ino == self._inode:
                        self.path.unlink()
                except FileNotFoundError:
                    pass
        self._inode = None
