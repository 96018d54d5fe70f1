"""vLLM with asynchronous scheduling: no page is unmapped while a step may still read it.

vLLM's own ``AsyncScheduler`` (patched) schedules step 2 before step 1's output is in;
step 1's output finishes a request, whose blocks go back to the pool while step 2 — which
the worker has not even launched yet — still reads them. The broker then lowers the lease,
so the pool wants that page gone. The worker's side is a rank server on the ``host``
backend, whose stream stands in for the GPU: step 2's attention is work launched on it
that reads the finished request's KV block, held until the test lets it run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.engines import vllm_common
from kvshare.runtime.pool import KVPool
from tests.engines.vllm.kv_setup import BLOCK_TOKENS, LAYERS, PAGE
from tests.engines.vllm.scheduler_setup import STOP, Engine, output, request, scheduled_engine
from tests.polling import wait_until

PATTERN = 42  # what the finished request's prefill "wrote" into its KV blocks


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Engine]:
    """vLLM's asynchronous scheduler over a worker's KV cache."""
    with scheduled_engine(monkeypatch, tmp_path, asynchronous=True, prefix_caching=True) as made:
        yield made


def prompt_of(request_id: str, blocks: int) -> Any:
    """A request whose prompt leaves room in its last block (decoding takes no new block)."""
    return request(request_id, blocks * BLOCK_TOKENS - 4)


class Attention:
    """Step 2's attention on the worker: launched on its stream, it reads a KV block once
    the test lets it run (and never reads if the test has already failed)."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.gate = threading.Event()
        self.cancelled = False
        self.read: int | None = None

    def __call__(self) -> None:
        self.gate.wait(60)
        if not self.cancelled:
            self.read = int(self.view.view(torch.uint8).flatten()[0])


def maintain_in_background(pool: KVPool) -> threading.Thread:
    """A maintenance pass, as the pool's own thread runs it (it may wait on a fence)."""
    thread = threading.Thread(target=pool.maintain, daemon=True)
    thread.start()
    thread.join(1.0)
    return thread


def test_a_page_freed_under_steps_in_flight_waits_for_their_output_and_for_the_device(
    engine: Engine,
) -> None:
    scheduler, pool, rank = engine.scheduler, engine.pool, engine.rank
    scheduler.add_request(prompt_of("b", 7))  # fills page 0 around the null block
    scheduler.add_request(prompt_of("a", 3))  # on page 1: the request that finishes
    step1 = scheduler.schedule()
    a_blocks = scheduler.kv_cache_manager.get_block_ids("a")[0]
    page = pool.geometry.page_of(a_blocks[-1])
    assert page != 0 and {pool.geometry.page_of(b) for b in a_blocks} == {page}
    layer0 = engine.kv_caches[LAYERS[0]]
    for block in a_blocks:
        layer0[block].view(torch.uint8).fill_(PATTERN)  # step 1's prefill writes a's KV
    step2 = scheduler.schedule()  # asynchronous: before step 1's output is in
    assert set(step2.num_scheduled_tokens) == {"a", "b"}

    scheduler.update_from_output(step1, output({"a": STOP, "b": 9}))  # a is finished
    assert not scheduler.kv_cache_manager.get_block_ids("a")[0], "a's blocks are still held"
    rank.lease.set_limit(1 * len(LAYERS) * PAGE)  # the broker reclaims: page 0 only
    assert not maintain_in_background(pool).is_alive()
    # Step 2 was handed out before a's blocks were freed, and its output is not back.
    assert page in rank.mapped_pages(), "unmapped while a scheduled step may still read it"

    backend = rank.backend
    assert isinstance(backend, HostBackend)
    attention = Attention(layer0[a_blocks[-1]])
    worker = SimpleNamespace(device=torch.device("cpu"))
    try:
        # The worker runs step 2 now: the patched execute_model marks its device fence.
        vllm_common.marking_the_device_fence(lambda _: backend.launch(attention))(worker)
        scheduler.update_from_output(step2, output({"b": 9}))  # step 2's output is back
        maintenance = maintain_in_background(pool)
        # Due by the scheduler's count, but step 2 still runs on this rank's device.
        assert page in rank.mapped_pages(), "unmapped while the device still reads it"
        attention.gate.set()
        maintenance.join(30)
        # The pool's own background thread may be the one that waits on the fence (the
        # passes are serialised): the page goes once step 2's read is done, whoever unmaps.
        wait_until(lambda: page not in rank.mapped_pages(), 30, "the page to be unmapped")
        assert attention.read == PATTERN  # no fault, no stale read
        assert pool.snapshot().held == 1 * len(LAYERS) * PAGE
    finally:
        attention.cancelled = True
        attention.gate.set()
