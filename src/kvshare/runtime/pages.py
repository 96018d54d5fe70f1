"""A pool's reserved virtual range and the physical pages mapped into it, by page id.

:class:`PageSpace` turns logical page ids of a :class:`~kvshare.runtime.geometry.KVGeometry`
into backend calls: one logical page is one physical page per buffer (per-layer layout)
or one compound page (contiguous layout). Every operation on a list of pages is all or
nothing: when one page fails, the pages done before it are rolled back and the error is
raised. The pool decides *which* pages; a page space only does what it is told, and
refuses what would corrupt it (a page created or mapped twice, an unknown page).

:class:`PageMapper` is what the pool drives: a page space for a local pool, or a
coordinated mapper that does the same on every tensor-parallel rank.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.errors import AlreadyMappedError, BackendError
from kvshare.runtime.geometry import KVGeometry

if TYPE_CHECKING:
    import torch

__all__ = ["PageMapper", "PageSpace"]

log = logging.getLogger(__name__)


class PageMapper(Protocol):
    """The page operations a pool performs; each takes a batch of logical page ids."""

    def create(self, pages: Sequence[int]) -> None:
        """Create the physical memory of ``pages`` (not mapped yet)."""

    def map(self, pages: Sequence[int]) -> None:
        """Map the created ``pages`` into the virtual range."""

    def unmap(self, pages: Sequence[int]) -> None:
        """Unmap ``pages``; their physical memory stays created."""

    def release(self, pages: Sequence[int]) -> None:
        """Give the physical memory of the unmapped ``pages`` back to the device."""

    def tensor(self, first: int, count: int) -> torch.Tensor:
        """A zero-copy view of buffers ``[first, first + count)``."""

    def block_address(self, buffer: int, block: int) -> int:
        """The virtual address of ``block`` in ``buffer``."""

    def close(self) -> None:
        """Unmap and release every page and give the virtual range back. Idempotent."""


def _all_or_nothing(
    pages: Sequence[int], do: Callable[[int], None], undo: Callable[[list[int]], None]
) -> None:
    """``do`` every page; when one fails, ``undo`` the pages done before it and raise."""
    done: list[int] = []
    try:
        for page in pages:
            do(page)
            done.append(page)
    except BaseException:
        undo(done)
        raise


class PageSpace:
    """One reserved virtual range laid out by a geometry, on one backend (one device)."""

    def __init__(self, geometry: KVGeometry, backend: Backend) -> None:
        geometry.check_granularity(backend.granularity)
        self.geometry = geometry
        self.backend = backend
        self.base = backend.reserve(geometry.virtual_bytes)
        self._chunks = geometry.page_chunks(0)  # page p: the same, shifted by p * stride
        self._page_stride = geometry.page_stride
        # _lock guards _handles, _mapped and _flat; it is held for bookkeeping only, never
        # across a backend call (the pool never runs two operations on one page at once).
        self._lock = threading.Lock()
        self._handles: dict[int, list[int]] = {}  # created page -> one handle per chunk
        self._mapped: set[int] = set()
        self._flat: torch.Tensor | None = None
        self._closed = False

    def _addresses(self, page: int) -> list[tuple[int, int]]:
        shift = self.base + page * self._page_stride
        return [(shift + offset, size) for offset, size in self._chunks]

    # --- page operations (all or nothing) -----------------------------------------------

    def create(self, pages: Sequence[int]) -> None:
        _all_or_nothing(pages, self._create_one, self._release_quietly)

    def _create_one(self, page: int) -> None:
        self._check_page(page)
        with self._lock:
            if page in self._handles:
                raise AlreadyMappedError(f"page {page} is already created; a duplicate is refused")
        handles: list[int] = []
        try:
            for _, size in self._chunks:
                handles.append(self.backend.create(size))
        except BaseException:
            for handle in handles:
                self.backend.release(handle)
            raise
        with self._lock:
            self._handles[page] = handles

    def map(self, pages: Sequence[int]) -> None:
        _all_or_nothing(pages, self._map_one, self._unmap_quietly)

    def _map_one(self, page: int) -> None:
        with self._lock:
            handles = self._handles.get(page)
            if handles is None:
                raise BackendError(f"page {page} is not created; create it before mapping")
            if page in self._mapped:
                raise AlreadyMappedError(
                    f"page {page} is already mapped; a duplicate map is refused"
                )
        backend = self.backend
        mapped: list[tuple[int, int]] = []
        try:
            for (address, size), handle in zip(self._addresses(page), handles, strict=True):
                backend.map(address, size, handle)
                mapped.append((address, size))
        except BaseException:
            for address, size in mapped:
                backend.unmap(address, size)
            raise
        with self._lock:
            self._mapped.add(page)

    def unmap(self, pages: Sequence[int]) -> None:
        """Unmap ``pages`` once the device work marked before now has finished (the
        device fence: an in-flight kernel may still read a page the engine just freed)."""
        if pages:
            self.backend.wait_fence()
        for page in pages:
            with self._lock:
                if page not in self._mapped:
                    raise BackendError(f"page {page} is not mapped")
            for address, size in self._addresses(page):
                self.backend.unmap(address, size)
            with self._lock:
                self._mapped.discard(page)

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            with self._lock:
                if page in self._mapped:
                    raise BackendError(f"page {page} is still mapped; unmap it before release")
                handles = self._handles.pop(page, None)
            if handles is None:
                raise BackendError(f"page {page} is not created")
            for handle in handles:
                self.backend.release(handle)

    def _unmap_quietly(self, pages: list[int]) -> None:
        try:
            self.unmap(pages)
        except BackendError:
            log.exception("rolling back the map of pages %s failed", pages)

    def _release_quietly(self, pages: list[int]) -> None:
        try:
            self.release(pages)
        except BackendError:
            log.exception("rolling back the creation of pages %s failed", pages)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.geometry.num_pages:
            raise BackendError(
                f"page {page} is outside the {self.geometry.num_pages} pages of this range"
            )

    # --- state and views ---------------------------------------------------------------

    def mapped_pages(self) -> frozenset[int]:
        """Page ids mapped now."""
        with self._lock:
            return frozenset(self._mapped)

    def created_pages(self) -> frozenset[int]:
        """Page ids whose physical memory exists (mapped or not)."""
        with self._lock:
            return frozenset(self._handles)

    def tensor(self, first: int, count: int) -> torch.Tensor:
        """A zero-copy uint8 view of buffers ``[first, first + count)`` shaped
        ``(count, num_blocks, block_bytes)`` (see :meth:`KVGeometry.buffer_view`)."""
        offset, shape, strides = self.geometry.buffer_view(first, count)
        with self._lock:
            if self._flat is None:
                self._flat = self.backend.tensor(self.base, self.geometry.virtual_bytes)
            flat = self._flat
        return flat.as_strided(shape, strides, offset)

    def block_address(self, buffer: int, block: int) -> int:
        """The virtual address of ``block`` in ``buffer`` (see :meth:`KVGeometry.buffer_view`)."""
        offset, shape, strides = self.geometry.buffer_view(buffer, 1)
        if not 0 <= block < shape[1]:
            raise ValueError(f"block {block} is outside the pool's {shape[1]} blocks")
        return self.base + offset + block * strides[1]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mapped = sorted(self._mapped)
            created = sorted(self._handles)
        self._unmap_quietly(mapped)
        self._release_quietly(created)
        try:
            self.backend.free_reservation(self.base)
        except BackendError:
            log.exception("giving back the reservation at 0x%x failed", self.base)
