"""A backend for simulated pools: virtual memory that is only bookkept.

:mod:`kvshare.demo.elastic_sim` runs real :class:`~kvshare.runtime.pool.KVPool` objects
over this backend, the lowest layer of the pool, which the simulation never reads or
writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvshare.runtime.backends.base import Backend, Reservations

if TYPE_CHECKING:
    import torch

__all__ = ["BookkeepingBackend"]


class BookkeepingBackend(Backend):
    """Virtual memory that is only bookkept: reservations, pages and mappings are checked
    as the ``host`` backend checks them (alignment, bounds, double maps, releasing a
    mapped page), but no memory is reserved, created or mapped. The pool's own logic runs
    unchanged; committing and punching host memory, which the simulation never touches,
    would cost most of its time."""

    name = "bookkeeping"

    def __init__(self, granularity: int) -> None:
        self._book = Reservations(granularity)
        self._next_address = 1 << 40
        self._pages: dict[int, int] = {}
        self._next_handle = itertools.count(1)

    @property
    def granularity(self) -> int:
        return self._book.granularity

    @property
    def device(self) -> str:
        return "cpu"

    def reserve(self, size: int) -> int:
        self._book.check_size(size, "reservation size")
        address = self._next_address
        self._next_address += size + self._book.granularity
        self._book.ranges[address] = size
        return address

    def free_reservation(self, address: int) -> None:
        self._book.check_unmapped_reservation(address)
        del self._book.ranges[address]

    def create(self, size: int) -> int:
        self._book.check_size(size, "page size")
        handle = next(self._next_handle)
        self._pages[handle] = size
        return handle

    def release(self, handle: int) -> None:
        self._book.check_releasable(handle, self._pages.get(handle))
        del self._pages[handle]

    def map(self, address: int, size: int, handle: int) -> None:
        self._book.check(address, size)
        self._book.check_not_mapped(address, handle)
        self._book.add_mapping(address, size, handle)

    def unmap(self, address: int, size: int) -> None:
        self._book.check_mapping(address, size)
        self._book.remove_mapping(address)

    def tensor(self, address: int, size: int) -> torch.Tensor:
        raise NotImplementedError("the simulation's pools hold no memory to view")

    def free_memory(self) -> int:
        return 1 << 50

    def record_fence(self, streams: Sequence[int] = (0,)) -> None:
        del streams  # no device work runs in the simulation: nothing to wait for

    def wait_fence(self) -> None:
        pass

    def close(self) -> None:
        self._book.mapped.clear()
        self._book.mapped_handles.clear()
        self._book.ranges.clear()
        self._pages.clear()
