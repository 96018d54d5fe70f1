"""The kubelet's PodResources API (``v1.PodResourcesLister``), read by the node agent:
which ``kvshare.io`` device ids each pod's containers got.

``Allocate`` carries no pod identity, so this is how the agent (like NVIDIA's plugin and
the GPU monitoring agents) learns which slots, hence which GPUs, a pod was given. ``Get``
asks for one pod (on by default since Kubernetes 1.34); a kubelet without it is asked
with ``List``. Stubs generated from ``podresources/v1/api.proto`` (``make proto``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

try:
    from kvshare.deviceplugin.kubelet.podresources.v1 import api_pb2 as prpb
    from kvshare.deviceplugin.kubelet.podresources.v1 import api_pb2_grpc as _prrpc
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("kvshare.deviceplugin.kubelet.podresources"):
        raise
    raise ImportError(
        "the kubelet PodResources API stubs are not generated: run `make proto` "
        "(or `python -m kvshare.deviceplugin.kubelet.protogen` with grpcio-tools installed)"
    ) from None

__all__ = ["PodResourcesClient", "PodResourcesError", "devices_of", "prpb", "prrpc"]

#: The generated gRPC module (untyped: stubs and ``add_*_to_server`` helpers).
prrpc: Any = _prrpc


class PodResourcesError(RuntimeError):
    """The kubelet's PodResources API cannot be asked; the message says why."""


def devices_of(pod: Any, resources: Iterable[str]) -> dict[str, list[str]]:
    """Device ids by resource name over all containers of ``pod`` (a ``PodResources``),
    for the ``resources`` asked about."""
    wanted = set(resources)
    found: dict[str, list[str]] = {}
    for container in pod.containers:
        for devices in container.devices:
            if devices.resource_name in wanted:
                found.setdefault(devices.resource_name, []).extend(devices.device_ids)
    return found


class PodResourcesClient:
    """Asks the kubelet at ``socket_path`` (thread-safe; one channel, reopened on failure)."""

    def __init__(self, socket_path: Path, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout_s
        self._lock = threading.Lock()  # guards _channel, _stub and _use_list
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._use_list = False

    def devices(
        self, namespace: str, name: str, resources: Iterable[str]
    ) -> dict[str, list[str]] | None:
        """Device ids by resource of pod ``namespace/name``, over its containers; None
        when the kubelet does not list the pod (not admitted yet, or gone). Raises
        :class:`PodResourcesError` when the kubelet cannot be asked."""
        stub, use_list = self._connect()
        try:
            if not use_list:
                try:
                    request = prpb.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
                    reply = stub.Get(request, timeout=self._timeout)
                    return devices_of(reply.pod_resources, resources)
                except grpc.RpcError as exc:
                    # A kubelet without Get says UNIMPLEMENTED, or (the feature gate off)
                    # "PodResources API Get method disabled".
                    disabled = "disabled" in (exc.details() or "")
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED and not disabled:
                        raise
                    with self._lock:
                        self._use_list = True
            listing = stub.List(prpb.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.close()
                raise PodResourcesError(
                    f"the kubelet's PodResources API at {self.socket_path} does not answer "
                    f"({exc.code().name}): mount /var/lib/kubelet/pod-resources into the agent"
                ) from None
            return None  # the kubelet's answer for a pod it does not know
        for pod in listing.pod_resources:
            if pod.namespace == namespace and pod.name == name:
                return devices_of(pod, resources)
        return None

    def close(self) -> None:
        """Close the channel (the next call opens a new one)."""
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def _connect(self) -> tuple[Any, bool]:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
                self._stub = prrpc.PodResourcesListerStub(self._channel)
            return self._stub, self._use_list
