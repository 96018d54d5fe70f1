"""vLLM's own block pool and KV cache manager, patched, serve blocks from a kvshare pool.

The KV cache config comes from vLLM's planner; the worker side runs vLLM's
``allocate_kv_cache`` (patched: a rank server on the host backend) inside the worker's
group, the scheduler side builds vLLM's ``KVCacheManager`` inside the scheduler's group
(patched: the owner pool of that group). Requests are vLLM ``Request`` objects with vLLM's
block hasher, driven through ``get_computed_blocks`` / ``allocate_slots`` / ``free``.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvshare.runtime.engines import pools, vllm_blocks, vllm_common
from kvshare.runtime.engines.activation import activate
from kvshare.runtime.pool import Exhausted, KVPool
from kvshare.runtime.rank_server import RankServer
from tests.engines.suite import eventually, standalone_host_pools
from tests.engines.vllm.kv_setup import (
    BLOCK_TOKENS,
    LAYERS,
    LEASE_PAGES,
    PAGE,
    VIRTUAL,
    allocate,
    kv_cache_config,
)

_groups = itertools.count()


@dataclass(repr=False)  # printing the views would read pages that are not mapped
class Engine:
    """One patched vLLM KV cache: the worker's views and rank server, the scheduler's manager."""

    manager: Any
    kv_caches: dict[str, torch.Tensor]
    rank: RankServer
    config: Any

    @property
    def pool(self) -> KVPool:
        queue = vllm_blocks.queue_of(self.manager.block_pool)
        assert queue is not None, "the block pool is not backed by kvshare"
        return queue.pool

    @property
    def queue(self) -> vllm_blocks.PooledFreeBlockQueue:
        queue = vllm_blocks.queue_of(self.manager.block_pool)
        assert queue is not None
        return queue


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Engine]:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    activate("vllm")
    standalone_host_pools(
        monkeypatch, tmp_path, page_size=PAGE, lease=LEASE_PAGES * len(LAYERS) * PAGE
    )
    config, layout, cache_config = kv_cache_config(VIRTUAL)
    group = vllm_common.Group(f"t{os.getpid()}-{next(_groups)}", 1)
    with vllm_common.worker_context(group, 0):
        kv_caches = allocate(config, layout)
    with vllm_common.scheduler_context(group, cache_config):
        manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK_TOKENS,
            hash_block_size=BLOCK_TOKENS,
            enable_caching=True,
        )
    rank = next(item for item in pools._opened if isinstance(item, RankServer))
    try:
        yield Engine(manager, kv_caches, rank, config)
    finally:
        pools.forget_pools()


_requests = itertools.count()


def request(tokens: list[int]) -> Any:
    """A vLLM request with vLLM's own block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=f"r{next(_requests)}",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256),
    )


def schedule(engine: Engine, req: Any) -> list[int] | None:
    """What vLLM's scheduler does for a new request: prefix lookup, then allocate slots."""
    computed, num_computed, *_ = engine.manager.get_computed_blocks(req)
    blocks = engine.manager.allocate_slots(
        req, req.num_tokens - num_computed, num_computed, computed
    )
    if blocks is None:
        return None
    req.num_computed_tokens = req.num_tokens
    ids: list[int] = engine.manager.get_block_ids(req.request_id)[0]
    return ids


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 1000 + i) % 30000 for i in range(blocks * BLOCK_TOKENS)]


def test_the_null_block_is_block_zero_and_never_handed_out(engine: Engine) -> None:
    assert engine.manager.block_pool.null_block.block_id == 0
    seen: set[int] = set()
    for seed in range(4):
        ids = schedule(engine, request(prompt(seed, 3)))
        assert ids is not None
        seen.update(ids)
    assert 0 not in seen
    assert engine.pool.snapshot().used_blocks == len(seen)


def test_blocks_come_from_the_pool_and_uncached_ones_go_back_at_once(engine: Engine) -> None:
    req = request(prompt(1, 3)[:40])  # 2 full blocks and a partial one
    ids = schedule(engine, req)
    assert ids is not None and len(ids) == 3
    assert engine.pool.snapshot().used_blocks == 3
    engine.manager.free(req)
    # Full blocks stay as prefix cache (held by vLLM, allocated in the pool); the partial
    # block had no hash and is free in the pool again.
    assert engine.queue.num_held_blocks == 2
    assert engine.pool.snapshot().used_blocks == 2


def test_a_prefix_hit_reuses_the_cached_blocks(engine: Engine) -> None:
    first = request(prompt(7, 4))
    first_ids = schedule(engine, first)
    assert first_ids is not None
    engine.manager.free(first)
    second = request([*prompt(7, 4), 1, 2, 3])
    _, num_computed, *_ = engine.manager.get_computed_blocks(second)
    assert num_computed == 4 * BLOCK_TOKENS
    ids = schedule(engine, second)
    assert ids is not None
    assert ids[:4] == first_ids[:4]
    assert engine.queue.num_held_blocks == 0


def test_exhaustion_makes_allocate_slots_say_no_and_takes_nothing(engine: Engine) -> None:
    held = schedule(engine, request(prompt(2, 30)))
    assert held is not None
    before = engine.pool.snapshot().used_blocks
    big = request(prompt(3, 20))
    assert schedule(engine, big) is None  # vLLM's own "no space": the scheduler preempts
    assert engine.pool.snapshot().used_blocks == before
    assert engine.manager.get_block_ids(big.request_id) == ([],)


def test_cached_blocks_are_evicted_to_make_room(engine: Engine) -> None:
    for seed in range(3):
        req = request(prompt(10 + seed, 10))
        assert schedule(engine, req) is not None
        engine.manager.free(req)
    assert engine.queue.num_held_blocks == 30
    big = request(prompt(99, 30))
    ids = schedule(engine, big)
    assert ids is not None and len(ids) == 30
    assert engine.queue.num_held_blocks < 30  # vLLM's LRU gave up cached blocks


def test_a_lowered_lease_evicts_cached_blocks_and_unmaps_their_pages(engine: Engine) -> None:
    for seed in range(3):
        req = request(prompt(20 + seed, 8))
        assert schedule(engine, req) is not None
        engine.manager.free(req)
    cached = engine.queue.num_held_blocks
    assert cached == 24
    mapped_before = engine.pool.snapshot().mapped
    engine.rank.lease.set_limit(1 * len(LAYERS) * PAGE)  # the broker reclaims: page 0 only
    assert eventually(
        lambda: engine.pool.snapshot().mapped <= len(LAYERS) * PAGE, engine.pool.maintain
    ), "the pool did not shrink to page 0"
    assert engine.queue.num_held_blocks == 0
    assert engine.pool.snapshot().mapped < mapped_before
    assert engine.rank.mapped_pages() == frozenset({0})
    hashes = request(prompt(20, 8)).block_hashes
    assert engine.manager.block_pool.get_cached_block(hashes[0], [0]) is None


def test_reset_prefix_cache_gives_cached_blocks_back(engine: Engine) -> None:
    req = request(prompt(5, 6))
    assert schedule(engine, req) is not None
    assert engine.manager.reset_prefix_cache() is False  # a block is in use
    engine.manager.free(req)
    assert engine.queue.num_held_blocks == 6
    assert engine.manager.reset_prefix_cache() is True
    assert engine.queue.num_held_blocks == 0
    assert engine.pool.snapshot().used_blocks == 0


def test_kv_views_are_the_pool_memory_of_each_block(engine: Engine) -> None:
    ids = schedule(engine, request(prompt(4, 3)))
    assert ids is not None
    block = ids[1]
    view = engine.kv_caches[LAYERS[1]]  # [blocks, heads, tokens, bytes]
    view[block].view(torch.uint8).fill_(0xA5)
    raw = engine.rank.tensor(1)[0]  # buffer of layer 1: (num_blocks, block_bytes)
    assert bool((raw[block] == 0xA5).all())
    assert int(raw[ids[0]].sum()) == 0  # its neighbour in the same request is untouched


def test_a_reclaim_between_counting_and_allocating_waits_for_the_step_to_end(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM counts free blocks and takes them later in the same scheduler step. A reclaim
    that lands in between (the broker's timing, not the engine's) must not make the
    allocation fail: the lower lease takes effect when the step ends."""
    pool = engine.pool
    told = threading.Event()
    tell_pool = pool.lease_changed

    def lease_changed(limit: int) -> None:
        tell_pool(limit)
        told.set()

    monkeypatch.setattr(pool, "lease_changed", lease_changed)  # the broker's path, observed
    block_pool = engine.manager.block_pool
    count_free = block_pool.get_num_free_blocks
    lower = 1 * len(LAYERS) * PAGE  # page 0 only: less than the request needs

    def count_then_reclaim() -> int:
        free = int(count_free())
        if not told.is_set():
            engine.rank.lease.set_limit(lower)
            assert told.wait(10), "the reclaim did not reach the scheduler's pool"
        return free

    monkeypatch.setattr(block_pool, "get_num_free_blocks", count_then_reclaim)
    req = request(prompt(40, 8))
    scheduler = SimpleNamespace(kv_cache_manager=engine.manager)
    step = vllm_blocks.scheduling_a_step(lambda _: schedule(engine, req))
    ids = step(scheduler)
    assert ids is not None and len(ids) == 8  # what vLLM counted is what it got
    assert pool.snapshot().lease == lower  # the reclaim took effect when the step ended
    # The step's output finishes the request (vLLM frees its blocks there).
    vllm_blocks.finishing_a_step(lambda _: engine.manager.free(req))(scheduler)
    assert eventually(lambda: pool.snapshot().mapped <= len(LAYERS) * PAGE, pool.maintain), (
        "the pool did not shrink to page 0 after the step"
    )


def test_blocks_the_pool_cannot_hand_out_after_all_fail_with_its_reason(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM takes the blocks it counted as free and cannot fail gracefully there: should
    the pool still refuse, the error that ends the engine says why."""
    refused = Exhausted("device memory: the device said no", 1, 0)
    monkeypatch.setattr(engine.pool, "alloc", lambda n: refused)
    with pytest.raises(ValueError, match="device memory: the device said no"):
        engine.queue.popleft_n(1)
