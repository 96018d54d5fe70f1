"""A stand-in for the kubelet's device manager, for tests, benchmarks and demos where no
kubelet runs.

It is real gRPC on real unix sockets and follows the kubelet's documented behaviour:
it serves ``Registration`` on ``<dir>/kubelet.sock``; inside ``Register`` it checks the
version and resource name (refusing with status UNKNOWN), dials the plugin back on
``<dir>/<endpoint>``, calls ``GetDevicePluginOptions`` and keeps a ``ListAndWatch``
stream open; a re-registration replaces the previous endpoint of that resource. A
restart deletes every socket in the directory, as a starting kubelet does.

With ``pod_resources_socket`` it also serves the PodResources API there (``List``,
``Get``, ``GetAllocatableResources``): the device ids it allocated to each pod's
containers, as a kubelet records them (:meth:`StandInKubelet.allocate` with a pod).
"""

from __future__ import annotations

import contextlib
import logging
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvshare.api import names
from kvshare.deviceplugin.kubelet.kubelet_api import API_VERSION, HEALTHY, pb, rpc
from kvshare.deviceplugin.kubelet.pod_resources import prpb, prrpc

__all__ = ["Endpoint", "StandInKubelet"]

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """A registered plugin as the stand-in kubelet knows it."""

    resource: str
    socket: Path
    options: Any
    channel: grpc.Channel
    stub: Any
    devices: dict[str, str] = field(default_factory=dict)
    """Device id -> health, from the latest ListAndWatch update."""
    updates: int = 0
    stream_open: bool = True


class StandInKubelet:
    """The kubelet's device-plugin side: registration, dial-back, ListAndWatch, and the
    calls the kubelet makes at pod admission (GetPreferredAllocation, Allocate)."""

    def __init__(
        self,
        directory: Path,
        dial_timeout_s: float = 10.0,
        *,
        pod_resources_socket: Path | None = None,
    ) -> None:
        self.directory = directory
        self.socket = directory / names.KUBELET_SOCKET_NAME
        self.pod_resources_socket = pod_resources_socket
        self._dial_timeout = dial_timeout_s
        # guards _endpoints, registrations and _assigned
        self._cond = threading.Condition()
        self._endpoints: dict[str, Endpoint] = {}
        self.registrations: list[tuple[str, float]] = []
        # (namespace, pod) -> container -> resource -> device ids
        self._assigned: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self._server: grpc.Server | None = None
        self._pod_resources: grpc.Server | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Serve Registration on ``kubelet.sock``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc.add_RegistrationServicer_to_server(_Registration(self), server)
        if not server.add_insecure_port(f"unix://{self.socket}"):
            raise OSError(f"cannot serve on {self.socket}")
        server.start()
        self._server = server
        if self.pod_resources_socket is not None and self._pod_resources is None:
            self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
            listing = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            prrpc.add_PodResourcesListerServicer_to_server(_PodResources(self), listing)
            if not listing.add_insecure_port(f"unix://{self.pod_resources_socket}"):
                raise OSError(f"cannot serve on {self.pod_resources_socket}")
            listing.start()
            self._pod_resources = listing

    def stop(self) -> None:
        """Stop serving and drop every plugin connection (the sockets stay)."""
        if self._server is not None:
            self._server.stop(grace=0).wait(5)
            self._server = None
        if self._pod_resources is not None:
            self._pod_resources.stop(grace=0).wait(5)
            self._pod_resources = None
        with self._cond:
            for endpoint in self._endpoints.values():
                endpoint.channel.close()
            self._endpoints.clear()
            self._cond.notify_all()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def restart(self) -> None:
        """Stop, delete every socket in the directory (plugins' too), and start again."""
        self.stop()
        for entry in self.directory.iterdir():
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
        self.start()

    # --- what a kubelet does with a registered plugin ------------------------------------

    def endpoint(self, resource: str) -> Endpoint:
        """The registered endpoint of ``resource`` (KeyError when not registered)."""
        with self._cond:
            return self._endpoints[resource]

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (evaluated under the stand-in's lock)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_registered(self, resource: str, count: int = 1, timeout: float = 30.0) -> bool:
        """Wait for the ``count``-th registration of ``resource`` and its first device list."""

        def done() -> bool:
            seen = sum(1 for name, _ in self.registrations if name == resource)
            endpoint = self._endpoints.get(resource)
            return seen >= count and endpoint is not None and endpoint.updates > 0

        return self.wait_for(done, timeout)

    def devices(self, resource: str) -> dict[str, str]:
        """Device id -> health as last streamed."""
        with self._cond:
            return dict(self._endpoints[resource].devices)

    def healthy(self, resource: str) -> list[str]:
        """Ids of the healthy devices."""
        return sorted(i for i, h in self.devices(resource).items() if h == HEALTHY)

    def preferred(
        self, resource: str, available: list[str], must_include: list[str], size: int
    ) -> list[str]:
        """GetPreferredAllocation for one container."""
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        response = self.endpoint(resource).stub.GetPreferredAllocation(request, timeout=10)
        return list(response.container_responses[0].deviceIDs)

    def allocate(
        self, resource: str, device_ids: list[str], pod: tuple[str, str, str] | None = None
    ) -> Any:
        """Allocate for one container; returns its ContainerAllocateResponse. With ``pod``
        (namespace, name, container) the ids are recorded for the PodResources API."""
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]
        )
        response = self.endpoint(resource).stub.Allocate(request, timeout=10)
        if pod is not None:
            namespace, name, container = pod
            with self._cond:
                containers = self._assigned.setdefault((namespace, name), {})
                containers.setdefault(container, {})[resource] = list(device_ids)
        return response.container_responses[0]

    def forget_pod(self, namespace: str, name: str) -> None:
        """The pod is gone: PodResources no longer lists it."""
        with self._cond:
            self._assigned.pop((namespace, name), None)

    def pod_resources(self, namespace: str, name: str) -> Any | None:
        """The ``PodResources`` message of a pod, or None when it has none recorded."""
        with self._cond:
            containers = self._assigned.get((namespace, name))
            if containers is None:
                return None
            return prpb.PodResources(
                name=name,
                namespace=namespace,
                containers=[
                    prpb.ContainerResources(
                        name=container,
                        devices=[
                            prpb.ContainerDevices(resource_name=r, device_ids=ids)
                            for r, ids in devices.items()
                        ],
                    )
                    for container, devices in containers.items()
                ],
            )

    def pods_with_resources(self) -> list[tuple[str, str]]:
        """(namespace, name) of every pod with recorded devices."""
        with self._cond:
            return list(self._assigned)

    # --- called by the Registration service -----------------------------------------------

    def _register(self, request: Any) -> str | None:
        """Accept a registration (dial back, options, stream) or say why not."""
        if request.version != API_VERSION:
            return f"unsupported device plugin API version {request.version!r}"
        domain, slash, _ = request.resource_name.partition("/")
        if not slash or "." not in domain or domain.endswith("kubernetes.io"):
            return f"invalid extended resource name {request.resource_name!r}"
        path = self.directory / request.endpoint
        channel = grpc.insecure_channel(f"unix://{path}")
        stub = rpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self._dial_timeout)
        except grpc.RpcError as exc:
            channel.close()
            return f"cannot dial the plugin back on {path}: {exc.code().name}"
        endpoint = Endpoint(request.resource_name, path, options, channel, stub)
        with self._cond:
            old = self._endpoints.get(request.resource_name)
            self._endpoints[request.resource_name] = endpoint
            self.registrations.append((request.resource_name, time.monotonic()))
            self._cond.notify_all()
        if old is not None:
            old.channel.close()
        threading.Thread(
            target=self._watch, args=(endpoint,), name="standin-kubelet-watch", daemon=True
        ).start()
        return None

    def _watch(self, endpoint: Endpoint) -> None:
        try:
            for update in endpoint.stub.ListAndWatch(pb.Empty()):
                with self._cond:
                    endpoint.devices = {d.ID: d.health for d in update.devices}
                    endpoint.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:
            endpoint.stream_open = False
            self._cond.notify_all()


class _Registration:
    def __init__(self, kubelet: StandInKubelet) -> None:
        self._kubelet = kubelet

    def Register(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        problem = self._kubelet._register(request)
        if problem is not None:
            context.abort(grpc.StatusCode.UNKNOWN, problem)
        return pb.Empty()


class _PodResources:
    """The PodResources API as a kubelet serves it, from the stand-in's records."""

    def __init__(self, kubelet: StandInKubelet) -> None:
        self._kubelet = kubelet

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        del request, context
        kubelet = self._kubelet
        pods = [kubelet.pod_resources(ns, name) for ns, name in kubelet.pods_with_resources()]
        return prpb.ListPodResourcesResponse(pod_resources=[p for p in pods if p is not None])

    def Get(self, request: Any, context: Any) -> Any:  # noqa: N802
        pod = self._kubelet.pod_resources(request.pod_namespace, request.pod_name)
        if pod is None:
            # What the kubelet answers (an error without a status: UNKNOWN on the wire).
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return prpb.GetPodResourcesResponse(pod_resources=pod)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        del request, context
        return prpb.AllocatableResourcesResponse()
