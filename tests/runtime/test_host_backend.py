"""The host backend: real reservations, a memfd as device memory, fixed shared mappings.

Pages are the same physical memory wherever they are mapped, releasing a page really gives
its memory back, and every address outside a reservation is refused before any system call.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import pytest

from kvshare.runtime.backends import open_backend
from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.errors import (
    AddressOutOfRangeError,
    AlreadyMappedError,
    BackendError,
)

PAGE = 2 * 2**20


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    host = HostBackend()
    yield host
    host.close()


def test_a_page_mapped_at_two_addresses_is_the_same_memory(backend: HostBackend) -> None:
    base = backend.reserve(4 * PAGE)
    page = backend.create(PAGE)
    backend.map(base, PAGE, page)
    backend.tensor(base, PAGE)[:8] = 42
    backend.unmap(base, PAGE)
    backend.map(base + 3 * PAGE, PAGE, page)
    assert backend.tensor(base + 3 * PAGE, PAGE)[:8].tolist() == [42] * 8
    backend.unmap(base + 3 * PAGE, PAGE)
    backend.release(page)


def test_releasing_a_page_gives_its_memory_back(backend: HostBackend) -> None:
    base = backend.reserve(2 * PAGE)
    assert backend.physical_bytes() == 0
    pages = [backend.create(PAGE) for _ in range(2)]
    assert backend.physical_bytes() == 2 * PAGE  # creating commits memory, as cuMemCreate
    backend.map(base, PAGE, pages[0])
    backend.tensor(base, PAGE).fill_(7)
    backend.unmap(base, PAGE)
    for page in pages:
        backend.release(page)
    assert backend.physical_bytes() == 0
    again = backend.create(PAGE)  # the released range is reused, and reads as zeros
    backend.map(base, PAGE, again)
    assert int(backend.tensor(base, PAGE).sum()) == 0


@pytest.mark.parametrize(
    ("offset", "size", "fragment"),
    [
        (-PAGE, PAGE, "outside every reservation"),
        (2 * PAGE, PAGE, "outside every reservation"),
        (PAGE, 2 * PAGE, "outside every reservation"),
        (100, PAGE, "not aligned"),
        (0, PAGE + 1, "not aligned"),
    ],
)
def test_addresses_outside_a_reservation_are_refused(
    backend: HostBackend, offset: int, size: int, fragment: str
) -> None:
    base = backend.reserve(2 * PAGE)
    page = backend.create(PAGE)
    with pytest.raises(AddressOutOfRangeError, match=fragment):
        backend.map(base + offset, size, page)
    with pytest.raises(AddressOutOfRangeError, match=fragment):
        backend.tensor(base + offset, size)
    assert backend.mapped_ranges() == {}


def test_a_duplicate_map_is_refused_and_changes_nothing(backend: HostBackend) -> None:
    base = backend.reserve(2 * PAGE)
    first, second = backend.create(PAGE), backend.create(PAGE)
    backend.map(base, PAGE, first)
    backend.tensor(base, PAGE)[0] = 5
    with pytest.raises(AlreadyMappedError, match="already mapped"):
        backend.map(base, PAGE, second)
    with pytest.raises(AlreadyMappedError, match="already mapped elsewhere"):
        backend.map(base + PAGE, PAGE, first)
    assert int(backend.tensor(base, PAGE)[0]) == 5
    assert backend.mapped_ranges() == {base: PAGE}


def test_a_mapped_page_cannot_be_released_and_a_reservation_in_use_cannot_be_freed(
    backend: HostBackend,
) -> None:
    base = backend.reserve(PAGE)
    page = backend.create(PAGE)
    backend.map(base, PAGE, page)
    with pytest.raises(BackendError, match="still mapped"):
        backend.release(page)
    with pytest.raises(AddressOutOfRangeError, match="still has 1 mapped pages"):
        backend.free_reservation(base)
    backend.unmap(base, PAGE)
    backend.release(page)
    backend.free_reservation(base)
    with pytest.raises(AddressOutOfRangeError):
        backend.unmap(base, PAGE)


def test_open_backend_host_and_unknown_kinds() -> None:
    backend = open_backend("host")
    try:
        assert backend.name == "host" and backend.device == "cpu"
        assert backend.granularity == mmap.PAGESIZE
        assert backend.free_memory() > 0
    finally:
        backend.close()
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        open_backend("tpu")  # type: ignore[arg-type]


def test_the_host_stream_runs_work_in_order_and_a_fence_waits_for_marked_work_only() -> None:
    backend = HostBackend()
    first, second = threading.Event(), threading.Event()
    ran: list[str] = []
    try:
        backend.launch(lambda: (first.wait(10), ran.append("first")))
        backend.record_fence()  # the step that launched "first"
        backend.launch(lambda: (second.wait(10), ran.append("second")))
        waiter = threading.Thread(target=backend.wait_fence)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "the fence passed while the marked work was still running"
        first.set()
        waiter.join(10)
        assert not waiter.is_alive() and ran == ["first"]  # "second" was launched after
    finally:
        first.set()
        second.set()
        backend.close()
    assert ran == ["first", "second"]
