"""The ``host`` backend: CUDA-style virtual memory management on CPU memory.

- reserve: ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`` — address space only;
- create: a range of one ``memfd`` (the backend's "device memory"), committed with
  ``fallocate`` so creating a page really takes memory, as ``cuMemCreate`` does;
- map: ``mmap(MAP_FIXED|MAP_SHARED, memfd, offset)`` over the reservation;
- unmap: remap the range ``PROT_NONE`` (it stays reserved, nothing else can land there);
- release: ``fallocate(PUNCH_HOLE)`` on the memfd range, so the memory really returns to
  the system and another process can take it (the analogue of ``cuMemRelease``);
- tensor: ``torch.frombuffer`` over the address range (zero copy);
- fence: the backend's :class:`~kvshare.runtime.fence.HostStream` (:meth:`HostBackend.launch`
  runs work on it in order, as kernels run on a CUDA stream); engines on a CPU compute
  synchronously and launch nothing there, so their fences pass at once.

Every address is bounds-checked against the reservations before any ``MAP_FIXED`` call.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap as _pymmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvshare.runtime.backends import libc
from kvshare.runtime.backends.base import Backend, Reservations
from kvshare.runtime.errors import (
    BackendError,
    MapCountExceededError,
    OutOfDeviceMemoryError,
)
from kvshare.runtime.fence import HostStream

if TYPE_CHECKING:
    import torch

__all__ = ["HostBackend", "map_count_error"]

log = logging.getLogger(__name__)

_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def map_count_error(exc: OSError) -> MapCountExceededError:
    """The clear error for an ``ENOMEM`` from ``mmap``: the process ran out of mappings."""
    try:
        with open(_MAX_MAP_COUNT, encoding="ascii") as f:
            limit = f.read().strip()
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            count = str(sum(1 for _ in f))
    except OSError:
        limit = count = "unknown"
    return MapCountExceededError(
        f"the kernel refused another memory mapping ({exc.strerror}): this process has "
        f"{count} mappings and vm.max_map_count is {limit}. Raise the limit on the node "
        "(sysctl -w vm.max_map_count=1048576) or use a larger page size (KVSHARE_PAGE_SIZE) "
        "so the KV cache needs fewer mappings"
    )


class HostBackend(Backend):
    """Virtual memory on the host, backed by one memfd. See the module docstring."""

    name = "host"

    def __init__(self) -> None:
        self._granularity = _pymmap.PAGESIZE
        self._fd = os.memfd_create("kvshare-kv-pages", os.MFD_CLOEXEC)
        self._lock = threading.Lock()  # guards everything below, and spans each syscall
        self._book = Reservations(self._granularity)
        self._file_size = 0
        self._next_offset = 0
        self._free_offsets: dict[int, list[int]] = {}  # page size -> released memfd offsets
        self._created: dict[int, int] = {}  # handle (= memfd offset) -> size
        # Addresses whose PROT_NONE placeholder could not be restored after an unmap: they
        # are mapped again only with MAP_FIXED_NOREPLACE.
        self._holes: set[int] = set()
        self._closed = False
        self.stream = HostStream()

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return "cpu"

    # --- reservations --------------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._book.check_size(size, "reservation size")
        flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
        with self._lock:
            self._check_open()
            try:
                address = libc.mmap(0, size, libc.PROT_NONE, flags)
            except OSError as exc:
                raise BackendError(
                    f"cannot reserve {size} bytes of address space: {exc.strerror}"
                ) from exc
            self._book.ranges[address] = size
        return address

    def free_reservation(self, address: int) -> None:
        with self._lock:
            size = self._book.check_unmapped_reservation(address)
            libc.munmap(address, size)
            del self._book.ranges[address]
            self._holes = {h for h in self._holes if not address <= h < address + size}

    # --- physical pages --------------------------------------------------------------

    def create(self, size: int) -> int:
        self._book.check_size(size, "page size")
        with self._lock:
            self._check_open()
            free = self._free_offsets.get(size)
            if free:
                offset = free.pop()
            else:
                offset = self._next_offset
                self._next_offset += size
                if self._next_offset > self._file_size:
                    self._file_size = max(self._next_offset, 2 * self._file_size)
                    os.ftruncate(self._fd, self._file_size)
            try:
                libc.fallocate(self._fd, 0, offset, size)
            except OSError as exc:
                self._free_offsets.setdefault(size, []).append(offset)
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise OutOfDeviceMemoryError(
                        f"host memory is exhausted: cannot commit a page of {size} bytes"
                    ) from exc
                raise BackendError(f"cannot create a page of {size} bytes: {exc}") from exc
            self._created[offset] = size
        return offset

    def release(self, handle: int) -> None:
        with self._lock:
            size = self._book.check_releasable(handle, self._created.get(handle))
            mode = libc.FALLOC_FL_PUNCH_HOLE | libc.FALLOC_FL_KEEP_SIZE
            libc.fallocate(self._fd, mode, handle, size)
            del self._created[handle]
            self._free_offsets.setdefault(size, []).append(handle)

    # --- mapping -----------------------------------------------------------------------

    def map(self, address: int, size: int, handle: int) -> None:
        with self._lock:
            self._check_open()
            self._book.check(address, size)
            self._book.check_not_mapped(address, handle)
            if self._created.get(handle) != size:
                raise BackendError(f"page {handle} is not a live page of {size} bytes")
            try:
                if address in self._holes:
                    libc.mmap(
                        address,
                        size,
                        libc.PROT_READ | libc.PROT_WRITE,
                        libc.MAP_SHARED | libc.MAP_FIXED_NOREPLACE,
                        fd=self._fd,
                        offset=handle,
                    )
                    self._holes.discard(address)
                else:
                    libc.map_shared_fixed(address, size, self._fd, handle)
            except OSError as exc:
                if exc.errno == errno.ENOMEM:
                    raise map_count_error(exc) from exc
                raise BackendError(f"cannot map page at 0x{address:x}: {exc}") from exc
            self._book.add_mapping(address, size, handle)

    def unmap(self, address: int, size: int) -> None:
        with self._lock:
            self._book.check_mapping(address, size)
            try:
                libc.protect_none_fixed(address, size)
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise BackendError(f"cannot unmap 0x{address:x}: {exc}") from exc
                self._unmap_at_map_limit(address, size)
            self._book.remove_mapping(address)

    def _unmap_at_map_limit(self, address: int, size: int) -> None:
        """At ``vm.max_map_count`` even the PROT_NONE remap can fail (it may split a
        mapping). ``munmap`` of a whole mapping never needs a new one; then the placeholder
        is put back without replacing anything."""
        libc.munmap(address, size)
        flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
        try:
            libc.mmap(address, size, libc.PROT_NONE, flags | libc.MAP_FIXED_NOREPLACE)
        except OSError:
            log.warning("address 0x%x left unreserved at the map-count limit", address)
            self._holes.add(address)

    # --- views and capacity --------------------------------------------------------------

    def tensor(self, address: int, size: int) -> torch.Tensor:
        import torch

        with self._lock:
            self._book.check(address, size)
        buffer = (ctypes.c_uint8 * size).from_address(address)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def free_memory(self) -> int:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise BackendError("/proc/meminfo has no MemAvailable line")

    # --- in-flight work --------------------------------------------------------------------

    def launch(self, work: Callable[[], object]) -> None:
        """Run ``work`` on this backend's stream, after the work launched before it."""
        self.stream.launch(work)

    def record_fence(self, streams: Sequence[int] = (0,)) -> None:
        del streams  # one stream on the host
        self.stream.mark()

    def wait_fence(self) -> None:
        self.stream.wait()

    def mapped_ranges(self) -> dict[int, int]:
        """Address -> size of every page mapped now."""
        with self._lock:
            return {address: size for address, (size, _) in self._book.mapped.items()}

    def physical_bytes(self) -> int:
        """Bytes of memory the memfd really holds now (what the kernel accounts to it)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        self.stream.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Unmapping a whole reservation also unmaps every page mapped inside it.
            self._book.mapped.clear()
            self._book.mapped_handles.clear()
            for address, size in self._book.ranges.items():
                libc.munmap(address, size)
            self._book.ranges.clear()
            self._created.clear()
            os.close(self._fd)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the host backend is closed")
