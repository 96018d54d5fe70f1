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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.engines import pools, vllm_blocks, vllm_common
from kvshare.runtime.engines.activation import activate
from kvshare.runtime.pool import KVPool
from kvshare.runtime.rank_server import RankServer
from tests.engines.suite import standalone_host_pools
from tests.engines.vllm.kv_setup import (
    BLOCK_TOKENS,
    LAYERS,
    LEASE_PAGES,
    PAGE,
    VIRTUAL,
    allocate,
    kv_cache_config,
    model_config,
)
from tests.polling import wait_until

STOP = 7  # the finished request's stop token
PATTERN = 42  # what its prefill "wrote" into its KV blocks


@dataclass(repr=False)  # printing the views would read pages that are not mapped
class Engine:
    scheduler: Any
    kv_caches: dict[str, torch.Tensor]
    rank: RankServer

    @property
    def pool(self) -> KVPool:
        queue = vllm_blocks.queue_of(self.scheduler.kv_cache_manager.block_pool)
        assert queue is not None
        return queue.pool


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Engine]:
    """A worker's KV cache and vLLM's asynchronous scheduler, grouped as vLLM groups them."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    activate("vllm")
    standalone_host_pools(
        monkeypatch, tmp_path, page_size=PAGE, lease=LEASE_PAGES * len(LAYERS) * PAGE
    )
    kv_config, layout, _ = kv_cache_config(VIRTUAL)
    config = VllmConfig(
        model_config=model_config(tmp_path),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
    )
    # Unique across processes: the group names the rank's socket in the abstract namespace,
    # which the engine suites of every vLLM line, run at once, share (vLLM's own instance
    # ids are random for the same reason).
    config.instance_id = f"fence-{uuid.uuid4().hex[:16]}"
    config.cache_config.kv_cache_layout = "LBHNC"  # as kv_cache_config lays it out
    config.scheduler_config.async_scheduling = True
    config.cache_config.num_gpu_blocks = kv_config.num_blocks  # as EngineCore sets it
    with vllm_common.worker_context(vllm_common.group_of(config), 0):
        kv_caches = allocate(kv_config, layout)
    scheduler = AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_TOKENS,
    )
    rank = next(item for item in pools._opened if isinstance(item, RankServer))
    try:
        yield Engine(scheduler, kv_caches, rank)
    finally:
        pools.forget_pools()


def request(request_id: str, blocks: int) -> Any:
    """A request whose prompt leaves room in its last block (decoding takes no new block)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=[
            (ord(request_id) * 97 + i) % 4000 for i in range(blocks * BLOCK_TOKENS - 4)
        ],
        sampling_params=SamplingParams(max_tokens=8, stop_token_ids=[STOP]),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256),
    )


def output(tokens: dict[str, int]) -> Any:
    """A step's model output: one sampled token per request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(tokens)
    fields = {"req_ids": ids, "sampled_token_ids": [[tokens[rid]] for rid in ids]}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # up to 0.33
        fields["req_id_to_index"] = {rid: i for i, rid in enumerate(ids)}
    return ModelRunnerOutput(**fields)


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
    scheduler.add_request(request("b", 7))  # fills page 0 around the null block
    scheduler.add_request(request("a", 3))  # on page 1: the request that finishes
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
