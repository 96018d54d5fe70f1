"""Generate the kubelet API stubs: the device plugin API (``v1beta1/api.proto``) and the
PodResources API (``podresources/v1/api.proto``).

``python -m kvshare.deviceplugin.kubelet.protogen`` (what ``make proto`` runs, and what an
image build runs) writes ``api_pb2.py``, ``api_pb2.pyi`` and ``api_pb2_grpc.py`` next to
each ``.proto``. They are generated, never committed, so they cannot drift from the
``.proto``. Needs ``grpcio-tools``; the generated code needs the ``grpcio``/``protobuf``
versions it was generated with or newer.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["PROTO", "PROTOS", "generate"]

#: The device plugin API's ``.proto``; its import path
#: (``kvshare/deviceplugin/kubelet/v1beta1/api.proto``) makes the generated modules import
#: each other as ``kvshare.deviceplugin.kubelet.v1beta1.*``.
PROTO = Path(__file__).resolve().parent / "v1beta1" / "api.proto"
#: Every ``.proto`` of the kubelet's APIs the node agent speaks.
PROTOS = (PROTO, Path(__file__).resolve().parent / "podresources" / "v1" / "api.proto")
#: ``src/``: the folder above ``kvshare/`` (v1beta1, kubelet, deviceplugin, kvshare, src).
_SOURCE_ROOT = PROTO.parents[4]


def generate() -> None:
    """Run ``grpc_tools.protoc`` on :data:`PROTOS`; raises RuntimeError when it fails."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError(
            "grpcio-tools is not installed: `pip install grpcio-tools` (or `make venv`) "
            "to generate the kubelet API stubs"
        ) from None
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTOS:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{_SOURCE_ROOT}",
                f"-I{include}",
                f"--python_out={_SOURCE_ROOT}",
                f"--pyi_out={_SOURCE_ROOT}",
                f"--grpc_python_out={_SOURCE_ROOT}",
                str(proto.relative_to(_SOURCE_ROOT)),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit status {status})")


if __name__ == "__main__":
    try:
        generate()
    except RuntimeError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.exit(1)
