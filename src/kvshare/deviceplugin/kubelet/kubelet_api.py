"""The kubelet device plugin API (v1beta1) messages and services.

Re-exports the stubs generated from ``v1beta1/api.proto``, and turns their absence into
an error that says how to generate them.
"""

from __future__ import annotations

from typing import Any

try:
    from kvshare.deviceplugin.kubelet.v1beta1 import api_pb2 as pb
    from kvshare.deviceplugin.kubelet.v1beta1 import api_pb2_grpc as _rpc
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("kvshare.deviceplugin.kubelet.v1beta1"):
        raise
    raise ImportError(
        "the kubelet device plugin API stubs are not generated: run `make proto` "
        "(or `python -m kvshare.deviceplugin.kubelet.protogen` with grpcio-tools installed)"
    ) from None

__all__ = ["API_VERSION", "HEALTHY", "UNHEALTHY", "pb", "rpc"]

#: The API version a plugin registers with.
API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

#: The generated gRPC module (untyped: stubs and ``add_*_to_server`` helpers).
rpc: Any = _rpc
