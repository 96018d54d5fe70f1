"""SGLang's allocation path never waits for the device.

SGLang's own allocators and KV pool (patched), on the CPU device. What a GPU would do with
a freed slot's ids is stood in for at the lowest layer: the copy to the host and the CUDA
event behind it (``host_copies``), whose completion the test decides. A free must return
at once — the pool cannot know the ids before the copy is done — and the pages reach the
pool once it is, while SGLang counts them as free all along.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.runtime.engines import host_copies
from tests.engines.sglang.test_token_pools import (  # noqa: F401 - env is a fixture
    LEASE_PAGES,
    build,
    env,
)


class Event:
    """A CUDA event whose work completes when the test says so."""

    def __init__(self, log: list[str]) -> None:
        self.complete = False
        self.log = log

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.log.append("waited for the device")
        self.complete = True


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Event], list[str]]:
    events: list[Event] = []
    log: list[str] = []

    def start_to_host(ids: torch.Tensor) -> host_copies.HostCopy:
        events.append(Event(log))
        return host_copies.HostCopy(ids.to(torch.int64).clone(), events[-1], ids)

    monkeypatch.setattr(host_copies, "start_to_host", start_to_host)
    return events, log


@pytest.mark.usefixtures("env")
def test_a_free_returns_before_the_device_copy_and_the_pages_follow_when_it_is_done(
    copies: tuple[list[Event], list[str]],
) -> None:
    events, log = copies
    cache = build(page_size=1)
    slots = cache.allocator.alloc(300)
    assert slots is not None
    available = cache.allocator.available_size()
    cache.allocator.free(slots)
    assert cache.pool.snapshot().used_blocks == 300, "the free read the ids off the device"
    assert cache.allocator.available_size() == available + 300  # SGLang sees them free
    for event in events:
        event.complete = True  # the device has copied them
    assert cache.allocator.alloc(1) is not None  # the next allocation hands them back
    assert cache.pool.snapshot().used_blocks == 1
    assert log == []  # nothing waited for the device


@pytest.mark.usefixtures("env")
def test_with_the_pool_full_an_allocation_waits_only_for_pages_on_their_way_back(
    copies: tuple[list[Event], list[str]],
) -> None:
    _, log = copies
    cache = build(page_size=1)
    everything = cache.allocator.alloc(cache.allocator.available_size())
    assert everything is not None and cache.pool.available() == 0
    cache.allocator.free(everything[:256])
    assert cache.allocator.alloc(256) is not None  # room only once the copy is in
    assert log == ["waited for the device"]
    assert cache.pool.snapshot().used_blocks == len(everything)
    assert len(everything) == LEASE_PAGES * 256 - 1
