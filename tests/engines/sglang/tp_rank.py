"""One SGLang tensor-parallel rank for the TP test: ``python -m tests.engines.sglang.tp_rank``.

Joins a real two-rank SGLang TP group (torch.distributed over gloo, SGLang's own
``init_distributed_environment`` and ``initialize_model_parallel``), then builds its KV
cache as SGLang's configurator does on every rank: ``MHATokenToKVPool`` with the model's
shape, the token allocator over it, the radix cache over the allocator — kvshare's patches
applied. It then serves the same schedule as its peer (SGLang ranks make identical
decisions), starting every iteration as SGLang's scheduler does (the ranks agree on their
lease there), and prints what its pool did as one JSON line. Map calls are counted by a
host backend that records every map and unmap per address.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvshare.runtime import backends
from tests.runtime import tp_rank as runtime_tp_rank


class CountingHostBackend(runtime_tp_rank.CountingHostBackend):
    """The runtime tests' counting host backend, also catching a map over a live mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.duplicates: list[int] = []

    def map(self, address: int, size: int, handle: int) -> None:
        if address in self.live:
            self.duplicates.append(address)
        super().map(address, size, handle)
        self.live.add(address)

    def unmap(self, address: int, size: int) -> None:
        super().unmap(address, size)
        self.live.discard(address)


def join_tp_group(rank: int, world_size: int, init_method: str) -> None:
    """SGLang's own TP bootstrap, on gloo (no GPU)."""
    import sglang
    from sglang.srt.distributed import parallel_state

    parallel_state.init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=init_method,
        local_rank=rank,
        backend="gloo",
    )
    if sglang.__version__.startswith("0.5.20"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        return
    # 0.5.23 reads the widths from its published parallel context; its documented way
    # to state them without a full ServerArgs is an override.
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_size=world_size,
        pp_size=1,
        moe_ep_size=1,
        attn_dp_size=1,
        attn_cp_size=1,
        moe_dp_size=1,
        attn_dcp_size=1,
        shared_experts_tp_size=None,
    )
    parallel_state.initialize_model_parallel()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    args = parser.parse_args()

    from kvshare.runtime.engines import pools, sglang_common
    from kvshare.runtime.engines.activation import activate

    counting = CountingHostBackend()
    backends.open_backend = lambda kind="auto", device=0: counting  # type: ignore[assignment]
    join_tp_group(args.rank, args.world_size, args.init_method)
    activate("sglang")

    from sglang.srt.distributed import parallel_state
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    size = 8 * 256 - 1
    kvcache = MHATokenToKVPool(
        size,
        page_size=1,
        dtype=torch.float16,
        head_num=2,
        head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(size, torch.float16, "cpu", kvcache, need_sort=False)
    tree = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(8, 4096, "cpu", False),
            token_to_kv_pool_allocator=allocator,
            page_size=1,
        )
    )
    pool = sglang_common.pool_of(kvcache)
    evictor = sglang_common.evictor_of(tree)
    assert pool is not None and evictor is not None
    handed: list[int] = []
    decisions: list[int | None] = []
    for step in range(16):
        evictor.step()  # what each scheduler iteration starts with (Scheduler.ingest_requests)
        slots = allocator.alloc(100 + step)
        decisions.append(None if slots is None else len(slots))
        if slots is None:
            continue  # SGLang's "no space": the request waits
        handed.extend(slots.tolist())
        if step % 2:
            allocator.free(slots[: len(slots) // 2])
    pool.maintain()
    # Both ranks ran the same schedule: their allocators must agree slot for slot.
    checksum = torch.tensor([sum(i * s for i, s in enumerate(handed))], dtype=torch.int64)
    peers = [torch.zeros_like(checksum) for _ in range(args.world_size)]
    torch.distributed.all_gather(peers, checksum, group=parallel_state.get_tp_group().cpu_group)
    base = counting.bases[0]
    page0 = [counting.maps[base + offset] for offset, _ in pool.geometry.page_chunks(0)]
    result = {
        "rank": pool.ownership.rank,
        "world_size": pool.ownership.world_size,
        "mode": pool.ownership.mode,
        "engine_tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "page0_maps": page0,
        "duplicate_maps": len(counting.duplicates),
        "mapped_pages": sorted(pool.mapped_pages()),
        "used_blocks": pool.snapshot().used_blocks,
        "in_step_with_peers": len({int(p) for p in peers}) == 1,
        "own_lease": pool.lease.own_limit(),  # type: ignore[attr-defined]
        "agreed_lease": pool.lease.limit(),
        "decisions": decisions,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    pools.forget_pools()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
