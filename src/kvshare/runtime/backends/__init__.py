"""Virtual-memory backends of the KV pool, behind one interface (:class:`Backend`).

``open_backend("host")`` works everywhere (CPU memory); ``open_backend("cuda", device)``
needs a CUDA driver and raises :class:`~kvshare.runtime.errors.BackendUnavailableError` with
the reason where there is none; ``"auto"`` takes ``cuda`` when a driver answers, else
``host`` (and logs why).
"""

from __future__ import annotations

import importlib
import logging
from typing import Literal

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.errors import BackendUnavailableError

__all__ = ["Backend", "BackendKind", "HostBackend", "open_backend"]

log = logging.getLogger(__name__)

BackendKind = Literal["host", "cuda", "auto"]


def _open_cuda(device: int) -> Backend:
    try:
        module = importlib.import_module("kvshare.runtime.backends.cuda")
    except ImportError as exc:
        raise BackendUnavailableError(f"the cuda backend cannot be imported: {exc}") from exc
    backend: Backend = module.CudaBackend(device)
    return backend


def open_backend(kind: BackendKind = "auto", device: int = 0) -> Backend:
    """Open a backend: ``host``, ``cuda`` (on CUDA device ``device``), or ``auto``."""
    if kind == "host":
        return HostBackend()
    if kind == "cuda":
        return _open_cuda(device)
    if kind == "auto":
        try:
            return _open_cuda(device)
        except BackendUnavailableError as exc:
            log.warning("no CUDA backend (%s); the KV pool uses host memory", exc)
            return HostBackend()
    raise ValueError(f"unknown backend {kind!r}: use host, cuda or auto")
