"""Every driver call of the cuda backend runs on its own device, from any thread, and leaves
the caller's current context as it found it (a pool on GPU 1 never reads GPU 0's memory).

The driver layer is a recording fake that keeps a context stack per thread the way the CUDA
driver does: this machine has no GPU (tests/gpu has the real-device checks).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from typing import Any

import pytest

from kvshare.runtime.backends.cuda import CudaBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.pool import KVPool

GIB = 2**30
GRANULARITY = 2 * 2**20
FREE = {0: 11 * GIB, 1: 37 * GIB}
SCOPE_FREE = {"device_get", "vmm_supported", "primary_ctx_retain", "primary_ctx_release"}


class RecordingDriver:
    """The driver calls of CudaDriver, recording the calling thread's current context."""

    def __init__(self) -> None:
        self.stacks: dict[int, list[str]] = defaultdict(list)  # thread id -> context stack
        self.calls: list[tuple[str, str | None, int]] = []
        self._lock = threading.Lock()
        self._addresses = itertools.count(1 << 40, 1 << 36)
        self._handles = itertools.count(1)

    def current(self) -> str | None:
        stack = self.stacks[threading.get_ident()]
        return stack[-1] if stack else None

    def make_current(self, context: str) -> None:
        """What torch.cuda.set_device does to the calling thread."""
        stack = self.stacks[threading.get_ident()]
        if stack:
            stack[-1] = context
        else:
            stack.append(context)

    def _record(self, call: str) -> str | None:
        current = self.current()
        with self._lock:
            self.calls.append((call, current, threading.get_ident()))
        return current

    def device_get(self, ordinal: int) -> int:
        self._record("device_get")
        return ordinal

    def vmm_supported(self, device: int) -> bool:
        self._record("vmm_supported")
        return True

    def primary_ctx_retain(self, device: int) -> str:
        self._record("primary_ctx_retain")
        return f"ctx-{device}"

    def primary_ctx_release(self, device: int) -> None:
        self._record("primary_ctx_release")

    def ctx_push(self, context: str) -> None:
        self.stacks[threading.get_ident()].append(context)

    def ctx_pop(self) -> None:
        self.stacks[threading.get_ident()].pop()

    def granularity(self, device: int) -> int:
        self._record("granularity")
        return GRANULARITY

    def mem_address_reserve(self, size: int, alignment: int) -> int:
        self._record("mem_address_reserve")
        return next(self._addresses)

    def mem_address_free(self, address: int, size: int) -> None:
        self._record("mem_address_free")

    def mem_create(self, size: int, device: int) -> int:
        self._record("mem_create")
        return next(self._handles)

    def mem_release(self, handle: Any) -> None:
        self._record("mem_release")

    def mem_map(self, address: int, size: int, handle: Any) -> None:
        self._record("mem_map")

    def mem_set_access(self, address: int, size: int, device: int) -> None:
        self._record("mem_set_access")

    def mem_unmap(self, address: int, size: int) -> None:
        self._record("mem_unmap")

    def event_create(self) -> str:
        self._record("event_create")
        return f"event-{next(self._handles)}"

    def event_record(self, event: str, stream: int) -> None:
        self._record(f"event_record {event} on stream {stream}")

    def event_synchronize(self, event: str) -> None:
        self._record(f"event_synchronize {event}")

    def event_destroy(self, event: str) -> None:
        self._record(f"event_destroy {event}")

    def mem_get_info(self) -> tuple[int, int]:
        current = self._record("mem_get_info")
        assert current is not None, "cuMemGetInfo with no current context"
        return FREE[int(current.removeprefix("ctx-"))], 80 * GIB


def scoped_calls_ran_on(driver: RecordingDriver, context: str) -> None:
    scoped = [(call, current) for call, current, _ in driver.calls if call not in SCOPE_FREE]
    assert scoped, "no driver call was recorded"
    assert all(current == context for _, current in scoped), scoped


def test_a_pool_on_device_1_does_everything_on_device_1_and_restores_each_thread() -> None:
    driver = RecordingDriver()
    driver.make_current("ctx-0")  # the engine's thread works on GPU 0 (torch's current device)
    geometry = KVGeometry(
        num_buffers=4, block_bytes=256 * 1024, num_blocks=512, page_size=GRANULARITY
    )
    backend = CudaBackend(1, driver=driver)  # type: ignore[arg-type]
    pool = KVPool(geometry, backend, StaticLease(64 * geometry.page_bytes), reserve_pages=3)
    held = [pool.alloc(9) for _ in range(20)]
    assert all(held)
    assert driver.current() == "ctx-0"
    for ids in held:
        pool.free(ids or [])
    pool.maintain()
    assert pool.snapshot().mapped > 0
    from_fresh_thread: list[int] = []
    worker = threading.Thread(target=lambda: from_fresh_thread.append(backend.free_memory()))
    worker.start()
    worker.join()
    assert from_fresh_thread == [FREE[1]]  # device 1's free memory, from a thread with no device
    assert backend.free_memory() == FREE[1]
    pool.close()
    assert driver.current() == "ctx-0"
    scoped_calls_ran_on(driver, "ctx-1")
    threads = {thread for _, _, thread in driver.calls}
    assert len(threads) >= 2, "the reserve thread made driver calls of its own"
    assert {call for call, _, _ in driver.calls} >= {
        "mem_create",
        "mem_map",
        "mem_set_access",
        "mem_unmap",
        "mem_release",
        "mem_address_reserve",
        "mem_address_free",
        "mem_get_info",
        "granularity",
    }
    for thread, stack in driver.stacks.items():
        expected = ["ctx-0"] if thread == threading.get_ident() else []
        assert stack == expected, f"thread {thread} was left with contexts {stack}"


def test_a_failing_driver_call_still_restores_the_callers_context() -> None:
    driver = RecordingDriver()
    backend = CudaBackend(1, driver=driver)  # type: ignore[arg-type]
    driver.make_current("ctx-0")

    def refuse(address: int, size: int, handle: Any) -> None:
        raise RuntimeError("mapping refused")

    driver.mem_map = refuse  # type: ignore[method-assign]
    address = backend.reserve(4 * GRANULARITY)
    page = backend.create(GRANULARITY)
    with pytest.raises(RuntimeError, match="mapping refused"):
        backend.map(address, GRANULARITY, page)
    assert driver.current() == "ctx-0"
    assert driver.stacks[threading.get_ident()] == ["ctx-0"]
    backend.close()


def test_an_unmap_waits_for_the_fence_events_of_the_engine_streams_on_its_own_device() -> None:
    driver = RecordingDriver()
    driver.make_current("ctx-0")
    geometry = KVGeometry(
        num_buffers=2, block_bytes=256 * 1024, num_blocks=64, page_size=GRANULARITY
    )
    backend = CudaBackend(1, driver=driver)  # type: ignore[arg-type]
    pool = KVPool(geometry, backend, StaticLease(8 * geometry.page_bytes), reserve_pages=0)
    ids = pool.alloc(9)  # page 0 and page 1
    assert ids
    backend.record_fence((7, 9))  # a step launched on the engine's two streams
    backend.record_fence((7, 9))  # and the next one: the same events, recorded again
    pool.free(ids)
    driver.calls.clear()
    worker = threading.Thread(target=pool.maintain)  # as the pool's own thread does
    worker.start()
    worker.join()
    calls = [(call, current) for call, current, _ in driver.calls]
    waits = [i for i, (call, _) in enumerate(calls) if call.startswith("event_synchronize")]
    unmaps = [i for i, (call, _) in enumerate(calls) if call == "mem_unmap"]
    assert unmaps and len(waits) == 2 and max(waits) < min(unmaps), calls
    assert all(current == "ctx-1" for _, current in calls), calls
    pool.close()
    events = {call.split()[1] for call, _, _ in driver.calls if call.startswith("event_destroy")}
    assert len(events) == 2  # one event per stream, destroyed with the backend
    assert driver.current() == "ctx-0"
