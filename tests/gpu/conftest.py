"""GPU tests: they run only where the cuda backend opens, and skip with its reason elsewhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.runtime.backends.cuda import CudaBackend
from kvshare.runtime.errors import BackendUnavailableError


def open_cuda(device: int) -> CudaBackend:
    """The cuda backend of ``device``, or a skip that says why there is none."""
    try:
        return CudaBackend(device)
    except BackendUnavailableError as exc:
        pytest.skip(f"needs a CUDA device {device}: {exc}")


@pytest.fixture
def cuda0() -> Iterator[CudaBackend]:
    backend = open_cuda(0)
    yield backend
    backend.close()
