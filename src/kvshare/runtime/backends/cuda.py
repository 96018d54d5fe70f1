"""The ``cuda`` backend: CUDA virtual memory management through cuda-python.

reserve = ``cuMemAddressReserve``; create = ``cuMemCreate`` (pinned device memory);
map = ``cuMemMap`` + ``cuMemSetAccess``; unmap = ``cuMemUnmap``; release =
``cuMemRelease``; tensors via DLPack (no C++ extension); free memory = ``cuMemGetInfo``;
fence = one event per engine stream, re-recorded after each step (``cuEventRecord``) and
synchronized before an unmap (``cuEventSynchronize``).

Device scoping: every driver call — from any thread, including background threads that
start with no current context — runs with this backend's device's primary context pushed
as current, and pops it afterwards, so the caller's current context is restored. A pool on
GPU 1 never maps on, or reads the free memory of, GPU 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvshare.runtime.backends.base import Backend, Reservations
from kvshare.runtime.backends.cuda_driver import CudaDriver, CudaError
from kvshare.runtime.backends.dlpack import DEVICE_CUDA, tensor_from_address
from kvshare.runtime.errors import (
    BackendError,
    BackendUnavailableError,
    OutOfDeviceMemoryError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["CudaBackend"]

log = logging.getLogger(__name__)


class CudaBackend(Backend):
    """Virtual memory on CUDA device ``device`` (an ordinal as this process sees them)."""

    name = "cuda"

    def __init__(self, device: int = 0, driver: CudaDriver | None = None) -> None:
        self._driver = driver or CudaDriver()
        self._index = device
        try:
            self._device = self._driver.device_get(device)
            if not self._driver.vmm_supported(self._device):
                raise BackendUnavailableError(
                    f"CUDA device {device} does not support virtual memory management"
                )
            self._context = self._driver.primary_ctx_retain(self._device)
        except CudaError as exc:
            raise BackendUnavailableError(f"CUDA device {device} is not usable: {exc}") from None
        # _lock guards the bookkeeping below and spans each driver call.
        self._lock = threading.Lock()
        with self._on_device():
            self._granularity = self._driver.granularity(self._device)
        self._book = Reservations(self._granularity)
        self._handles: dict[int, tuple[Any, int]] = {}  # handle id -> (driver handle, size)
        self._closed = False
        # _fence_lock guards _fence_events; never held across a wait, never with _lock, so
        # the engine's thread recording a fence never waits for the pool's thread waiting.
        self._fence_lock = threading.Lock()
        self._fence_events: dict[int, Any] = {}  # stream handle -> its latest fence event

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Run the body with this device's context current; restore the caller's after."""
        self._driver.ctx_push(self._context)
        try:
            yield
        finally:
            self._driver.ctx_pop()

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return f"cuda:{self._index}"

    # --- reservations --------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._book.check_size(size, "reservation size")
        with self._lock, self._on_device():
            self._check_open()
            address = self._driver.mem_address_reserve(size, self._granularity)
            self._book.ranges[address] = size
        return address

    def free_reservation(self, address: int) -> None:
        with self._lock:
            size = self._book.check_unmapped_reservation(address)
            with self._on_device():
                self._driver.mem_address_free(address, size)
            del self._book.ranges[address]

    # --- physical pages -------------------------------------------------------------------

    def create(self, size: int) -> int:
        self._book.check_size(size, "page size")
        with self._lock, self._on_device():
            self._check_open()
            try:
                handle = self._driver.mem_create(size, self._device)
            except CudaError as exc:
                if exc.out_of_memory:
                    raise OutOfDeviceMemoryError(
                        f"CUDA device {self._index} has no memory for a page of {size} bytes"
                    ) from exc
                raise
            key = int(handle)
            self._handles[key] = (handle, size)
        return key

    def release(self, handle: int) -> None:
        with self._lock:
            entry = self._book.check_releasable(handle, self._handles.get(handle))
            with self._on_device():
                self._driver.mem_release(entry[0])
            del self._handles[handle]

    # --- mapping ------------------------------------------------------------------------

    def map(self, address: int, size: int, handle: int) -> None:
        with self._lock:
            self._check_open()
            self._book.check(address, size)
            self._book.check_not_mapped(address, handle)
            entry = self._handles.get(handle)
            if entry is None or entry[1] != size:
                raise BackendError(f"page {handle} is not a live page of {size} bytes")
            with self._on_device():
                self._driver.mem_map(address, size, entry[0])
                try:
                    self._driver.mem_set_access(address, size, self._device)
                except BaseException:
                    self._driver.mem_unmap(address, size)
                    raise
            self._book.add_mapping(address, size, handle)

    def unmap(self, address: int, size: int) -> None:
        with self._lock:
            self._book.check_mapping(address, size)
            with self._on_device():
                self._driver.mem_unmap(address, size)
            self._book.remove_mapping(address)

    # --- views and capacity --------------------------------------------------------------

    def tensor(self, address: int, size: int) -> torch.Tensor:
        with self._lock:
            self._book.check(address, size)
        return tensor_from_address(address, size, device_type=DEVICE_CUDA, device_id=self._index)

    def free_memory(self) -> int:
        with self._lock, self._on_device():
            free, _ = self._driver.mem_get_info()
        return free

    # --- the device fence ----------------------------------------------------------------

    def record_fence(self, streams: Sequence[int] = (0,)) -> None:
        with self._fence_lock, self._on_device():
            for stream in streams:
                event = self._fence_events.get(stream)
                if event is None:
                    event = self._fence_events[stream] = self._driver.event_create()
                self._driver.event_record(event, stream)

    def wait_fence(self) -> None:
        with self._fence_lock:
            events = list(self._fence_events.values())
        if events:
            with self._on_device():
                for event in events:
                    self._driver.event_synchronize(event)

    def close(self) -> None:
        with self._fence_lock:
            events, self._fence_events = list(self._fence_events.values()), {}
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._on_device():
                for event in events:
                    self._quietly(self._driver.event_destroy, event)
                for address, (size, _) in list(self._book.mapped.items()):
                    self._quietly(self._driver.mem_unmap, address, size)
                for handle, _ in self._handles.values():
                    self._quietly(self._driver.mem_release, handle)
                for address, size in self._book.ranges.items():
                    self._quietly(self._driver.mem_address_free, address, size)
            self._book.mapped.clear()
            self._book.mapped_handles.clear()
            self._book.ranges.clear()
            self._handles.clear()
            self._quietly(self._driver.primary_ctx_release, self._device)

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except CudaError:
            log.exception("CUDA clean-up call failed")

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"the cuda backend of device {self._index} is closed")
