"""SGLang's own KV pool, slot allocators and radix cache, patched, serve slots from a kvshare pool.

Built as SGLang's configurator builds them (``MHATokenToKVPool`` with the model's shape,
then the allocator over it, then the radix cache over the allocator) on the CPU device,
with the pool on the host backend and a fixed lease; driven through their public methods.
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshare.api.engines import parse_release
from kvshare.runtime.engines import pools, sglang_common
from kvshare.runtime.engines.activation import activate, engine_version
from kvshare.runtime.pool import KVPool
from tests.engines.suite import eventually, standalone_host_pools

HEADS, HEAD_DIM, LAYERS = 2, 64, 2
ROW = HEADS * HEAD_DIM * 2  # bytes of one token's K (or V) in one layer, float16
PAGE = 64 * 2**10  # 256 token rows per page and buffer
SIZE = 8 * 256 - 1  # SGLang adds the padding slot: 8 pages of virtual capacity
LEASE_PAGES = 3  # 255 + 256 + 256 slots


@dataclass(repr=False)  # printing the buffers would read pages that are not mapped
class Cache:
    kvcache: Any
    allocator: Any
    tree: Any

    @property
    def pool(self) -> KVPool:
        pool = sglang_common.pool_of(self.kvcache)
        assert pool is not None, "the KV pool is not backed by kvshare"
        return pool


def build(page_size: int) -> Cache:
    """KV pool, allocator and radix cache, in the order SGLang's configurator builds them."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    kvcache = MHATokenToKVPool(
        SIZE + 1 - page_size,
        page_size=page_size,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(SIZE, torch.float16, "cpu", kvcache, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            SIZE + 1 - page_size, page_size, torch.float16, "cpu", kvcache, need_sort=True
        )
    requests = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    tree = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=requests,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
    )
    return Cache(kvcache, allocator, tree)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    activate("sglang")
    standalone_host_pools(
        monkeypatch, tmp_path, page_size=PAGE, lease=LEASE_PAGES * 2 * LAYERS * PAGE
    )
    try:
        yield
    finally:
        pools.forget_pools()


@pytest.fixture
def cache(env: None) -> Cache:
    return build(page_size=1)


def key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array.array("i", tokens))


def matched(cache: Cache, tokens: list[int]) -> int:
    from sglang.srt.mem_cache.radix_cache import MatchPrefixParams

    result = cache.tree.match_prefix(MatchPrefixParams(key=key(tokens)))
    if hasattr(result, "device_prefix_len"):
        return int(result.device_prefix_len)
    return len(result.device_indices)  # 0.5.20


def insert(cache: Cache, tokens: list[int], slots: torch.Tensor) -> None:
    from sglang.srt.mem_cache.radix_cache import InsertParams

    cache.tree.insert(InsertParams(key=key(tokens), value=slots))


def test_slots_come_from_the_pool_and_go_back_on_free(cache: Cache) -> None:
    slots = cache.allocator.alloc(300)
    assert slots is not None and len(slots) == 300
    assert cache.pool.snapshot().used_blocks == 300
    assert len(set(slots.tolist())) == 300
    cache.allocator.free(slots[:100])
    assert cache.pool.snapshot().used_blocks == 200
    assert len(cache.allocator.free_pages) == 0  # nothing parked outside the pool


def test_the_padding_slot_is_reserved(cache: Cache) -> None:
    slots = cache.allocator.alloc(700)
    assert slots is not None
    assert 0 not in slots.tolist()
    assert cache.pool.snapshot().used_blocks == 700


def test_exhaustion_is_sglangs_no_space_answer(cache: Cache) -> None:
    capacity = cache.allocator.available_size()
    assert capacity == 255 + 2 * 256  # the lease, not the 2047-slot virtual size
    held = cache.allocator.alloc(capacity)
    assert held is not None
    assert cache.allocator.alloc(1) is None  # SGLang's own "no space": evict or retract
    assert cache.pool.snapshot().used_blocks == capacity
    cache.allocator.free(held[:10])
    again = cache.allocator.alloc(10)
    assert again is not None and len(again) == 10


def test_kv_buffers_are_the_pool_memory_of_each_slot(cache: Cache) -> None:
    slots = cache.allocator.alloc(3)
    assert slots is not None
    slot = int(slots[1])
    cache.kvcache.get_key_buffer(1)[slot].fill_(1.5)
    cache.kvcache.get_value_buffer(1)[slot].fill_(-2.0)
    k_raw = cache.pool.tensor(2 * 1)[0][slot].view(torch.float16)
    v_raw = cache.pool.tensor(2 * 1 + 1)[0][slot].view(torch.float16)
    assert bool((k_raw == 1.5).all()) and bool((v_raw == -2.0).all())
    assert cache.kvcache.get_key_buffer(1).data_ptr() == cache.pool.tensor(2)[0].data_ptr()


def test_radix_cache_holds_evicts_and_frees_through_the_pool(cache: Cache) -> None:
    tokens = list(range(100, 400))
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    insert(cache, tokens, slots)
    assert matched(cache, [*tokens, 7, 8]) == len(tokens)
    assert cache.tree.evictable_size() == len(tokens)
    evictor = sglang_common.evictor_of(cache.tree)
    assert evictor is not None
    assert evictor.cached_blocks() == len(tokens)
    # The pool asks from its thread; the scheduler carries it out at its next iteration.
    assert evictor.evict(120) == 0
    assert cache.pool.snapshot().used_blocks == len(tokens)
    assert evictor.step() >= 120
    left = cache.tree.evictable_size()
    assert left <= len(tokens) - 120
    assert cache.pool.snapshot().used_blocks == left
    assert matched(cache, tokens) == left


def test_a_lowered_lease_is_honoured_by_evicting_the_radix_cache(cache: Cache) -> None:
    tokens = list(range(1000, 1600))
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    insert(cache, tokens, slots)
    cache.pool.lease.set_limit(1 * 2 * LAYERS * PAGE)  # the broker reclaims: page 0 only
    evictor = sglang_common.evictor_of(cache.tree)
    assert evictor is not None
    # The pool's thread asks the evictor; the scheduler's next iteration evicts.
    assert eventually(
        lambda: cache.pool.mapped_pages() == frozenset({0}),
        lambda: (cache.pool.maintain(), evictor.step()),
    ), "the pool did not shrink to page 0"
    assert cache.tree.evictable_size() == 0


def test_paged_allocator_serves_whole_pages_from_the_pool(env: None) -> None:
    cache = build(page_size=16)
    slots = cache.allocator.alloc(64)
    assert slots is not None and len(slots) == 64
    pages = sorted({int(s) // 16 for s in slots.tolist()})
    assert len(pages) == 4 and 0 not in pages
    assert cache.pool.snapshot().used_blocks == 4
    cache.allocator.free(slots)
    assert cache.pool.snapshot().used_blocks == 0
    capacity_pages = cache.allocator.available_size() // 16
    assert cache.allocator.alloc((capacity_pages + 1) * 16) is None


def test_paged_extend_and_decode_take_pages_from_the_pool(env: None) -> None:
    if parse_release(engine_version("sglang")) < (0, 5, 23):
        pytest.skip("SGLang 0.5.20's paged alloc_extend/alloc_decode launch Triton kernels (GPU)")
    cache = build(page_size=16)
    prefix = torch.tensor([0, 0]), torch.tensor([0, 0])
    seq = torch.tensor([20, 5]), torch.tensor([20, 5])
    last_loc = torch.tensor([-1, -1])
    out = cache.allocator.alloc_extend(prefix[0], prefix[1], seq[0], seq[1], last_loc, 25)
    assert out is not None and len(out) == 25
    assert cache.pool.snapshot().used_blocks == 3  # 2 pages + 1 page
    decode_last = torch.tensor([int(out[19]), int(out[24])])
    step = cache.allocator.alloc_decode(torch.tensor([21, 6]), torch.tensor([21, 6]), decode_last)
    assert step is not None and len(step) == 2
    assert cache.pool.snapshot().used_blocks == 3  # both fit their current pages


def test_an_allocator_kvshare_does_not_serve_is_refused_at_start_up(env: None) -> None:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    from kvshare.runtime.engines.pools import EngineConfigError

    class OtherAllocator(TokenToKVPoolAllocator):  # e.g. a platform's own allocator
        pass

    cache = build(page_size=1)
    with pytest.raises(EngineConfigError, match="does not serve SGLang's OtherAllocator"):
        OtherAllocator(SIZE, torch.float16, "cpu", cache.kvcache, need_sort=False)


def test_sglangs_own_vmm_arena_is_refused_naming_its_variable(
    env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvshare.runtime.engines.pools import EngineConfigError

    cache = build(page_size=1)
    # The KV pool's own path to the arena (taken when SGLang sizes KV after graph capture)
    # never reserves it beside kvshare's pool.
    with pytest.raises(EngineConfigError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=0"):
        cache.kvcache._alloc_post_capture_buffers()
    # And the setting itself stops start-up before anything is reserved.
    monkeypatch.setenv(sglang_common.VMM_ARENA_VARIABLE, "1")
    with pytest.raises(EngineConfigError, match="one KV cache gets one reservation"):
        sglang_common.refuse_vmm_arena()
