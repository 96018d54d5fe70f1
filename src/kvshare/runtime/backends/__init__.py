"""Virtual-memory backends of the KV pool, behind one interface (:class:`Backend`).

``open_backend("host")`` works everywhere (CPU memory); ``open_backend("cuda", device)``
needs a CUDA driver and raises :class:`~kvshare.runtime.errors.BackendUnavailableError` with
the reason where there is none; ``"auto"`` takes ``cuda`` when a driver answers, and ``host``
only where this container has no GPU (see :mod:`.gpu_presence`): with GPUs allocated and no
working ``cuda`` backend it refuses, naming what it found.
"""

from __future__ import annotations

import importlib
import logging
from typing import Literal

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.backends.gpu_presence import cuda_versions, gpu_evidence
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
            evidence = gpu_evidence()
            if evidence:
                raise BackendUnavailableError(
                    f"KVSHARE_BACKEND=auto: this container has GPUs ({'; '.join(evidence)}) "
                    f"but the cuda backend cannot start: {exc}. Found: {cuda_versions()}. "
                    "kvshare will not put the KV cache in host memory on a GPU node; make "
                    "kvshare's cuda-python (>= 12.6, with cuda.bindings) the one Python imports "
                    "and run a driver it supports, or set KVSHARE_BACKEND=host to use host "
                    "memory on purpose"
                ) from None
            log.warning("no GPU here (%s); the KV pool uses host memory", exc)
            return HostBackend()
    raise ValueError(f"unknown backend {kind!r}: use host, cuda or auto")
