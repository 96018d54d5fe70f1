"""The small interface every virtual-memory backend implements.

The model is CUDA's virtual memory management: *reserve* a virtual range, *create*
physical pages, *map* a page at an address inside a reservation, *unmap* it, *release*
its physical memory. A backend bounds-checks every address against its reservations and
refuses to map an address twice, so a pool bug is an exception and never a silently
corrupted process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from kvshare.runtime.errors import AddressOutOfRangeError, AlreadyMappedError, BackendError

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "Reservations"]

T = TypeVar("T")


class Backend(ABC):
    """Virtual memory on one device. Thread-safe: every method may be called from any thread."""

    #: ``"host"`` or ``"cuda"``.
    name: str

    @property
    @abstractmethod
    def granularity(self) -> int:
        """Addresses and sizes of :meth:`map`/:meth:`create` must be multiples of this."""

    @property
    @abstractmethod
    def device(self) -> str:
        """The torch device that tensors of this backend live on (``"cpu"``, ``"cuda:1"``)."""

    @abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space (no physical memory); its address."""

    @abstractmethod
    def free_reservation(self, address: int) -> None:
        """Give a reservation back; everything mapped inside it must be unmapped first."""

    @abstractmethod
    def create(self, size: int) -> int:
        """Create a physical page of ``size`` bytes; returns its handle.

        Raises :class:`~kvshare.runtime.errors.OutOfDeviceMemoryError` when the device is full.
        """

    @abstractmethod
    def release(self, handle: int) -> None:
        """Give a physical page's memory back to the device (it must not be mapped)."""

    @abstractmethod
    def map(self, address: int, size: int, handle: int) -> None:
        """Map physical page ``handle`` read-write at ``address`` (inside a reservation)."""

    @abstractmethod
    def unmap(self, address: int, size: int) -> None:
        """Unmap what :meth:`map` mapped at ``address``; the address stays reserved."""

    @abstractmethod
    def tensor(self, address: int, size: int) -> torch.Tensor:
        """A zero-copy 1-D uint8 tensor over ``[address, address + size)`` of a reservation."""

    @abstractmethod
    def free_memory(self) -> int:
        """Free physical memory of this backend's own device, in bytes."""

    @abstractmethod
    def record_fence(self, streams: Sequence[int] = (0,)) -> None:
        """Mark the device work launched so far on ``streams`` (CUDA stream handles, 0 the
        default stream); :meth:`wait_fence` waits for it. Engine hooks call this after each
        step is launched, never on the allocation path (see :mod:`kvshare.runtime.fence`)."""

    @abstractmethod
    def wait_fence(self) -> None:
        """Block until the work marked by the latest :meth:`record_fence` has finished.
        Called before every unmap, from the pool's threads (never under the pool's lock)."""

    @abstractmethod
    def close(self) -> None:
        """Unmap and release everything, give reservations back. Idempotent."""


class Reservations:
    """Bookkeeping shared by backends: live reservations and what is mapped where.

    Not thread-safe on its own; the backend holds its lock around every call.
    """

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity
        self.ranges: dict[int, int] = {}  # base address -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.mapped_handles: set[int] = set()

    def check_size(self, size: int, what: str) -> None:
        """Raise :class:`AddressOutOfRangeError` unless ``size`` is a positive multiple of the
        granularity (``what``: "page size", "reservation size")."""
        if size <= 0 or size % self.granularity:
            raise AddressOutOfRangeError(
                f"{what} {size} is not a positive multiple of {self.granularity}"
            )

    def check_releasable(self, handle: int, entry: T | None) -> T:
        """``entry`` (what the backend knows of page ``handle``), after checking the page is
        live (``entry`` is not ``None``) and not mapped; else :class:`BackendError`."""
        if entry is None:
            raise BackendError(f"page {handle} is not a live page of this backend")
        if handle in self.mapped_handles:
            raise BackendError(f"page {handle} is still mapped; unmap it before release")
        return entry

    def check(self, address: int, size: int) -> None:
        """Raise :class:`AddressOutOfRangeError` unless the range is aligned and inside one
        reservation."""
        if size <= 0 or address % self.granularity or size % self.granularity:
            raise AddressOutOfRangeError(
                f"range 0x{address:x}+{size} is not aligned to the granularity "
                f"{self.granularity}; refused"
            )
        for base, length in self.ranges.items():
            if base <= address and address + size <= base + length:
                return
        raise AddressOutOfRangeError(
            f"range 0x{address:x}+{size} is outside every reservation of this backend; "
            "refused (a fixed mapping there would overwrite unrelated memory)"
        )

    def check_not_mapped(self, address: int, handle: int) -> None:
        """:class:`AlreadyMappedError` if the address or the page is mapped already."""
        if address in self.mapped:
            raise AlreadyMappedError(f"0x{address:x} is already mapped; a duplicate map is refused")
        if handle in self.mapped_handles:
            raise AlreadyMappedError(f"page {handle} is already mapped elsewhere; refused")

    def add_mapping(self, address: int, size: int, handle: int) -> None:
        """Record a mapping (checked by :meth:`check` and :meth:`check_not_mapped`)."""
        self.mapped[address] = (size, handle)
        self.mapped_handles.add(handle)

    def check_mapping(self, address: int, size: int) -> int:
        """The handle mapped at ``address`` with ``size``, or :class:`AddressOutOfRangeError`."""
        entry = self.mapped.get(address)
        if entry is None or entry[0] != size:
            raise AddressOutOfRangeError(f"nothing of {size} bytes is mapped at 0x{address:x}")
        return entry[1]

    def remove_mapping(self, address: int) -> None:
        """Forget the mapping at ``address``."""
        _, handle = self.mapped.pop(address)
        self.mapped_handles.discard(handle)

    def check_unmapped_reservation(self, base: int) -> int:
        """The size of reservation ``base``, after checking nothing is mapped inside it."""
        if base not in self.ranges:
            raise AddressOutOfRangeError(f"0x{base:x} is not the start of a reservation")
        size = self.ranges[base]
        inside = [a for a in self.mapped if base <= a < base + size]
        if inside:
            raise AddressOutOfRangeError(
                f"reservation 0x{base:x} still has {len(inside)} mapped pages; unmap them first"
            )
        return size
