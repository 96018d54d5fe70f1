"""One vLLM worker's KV cache in block-outer pages, on a stand-in CUDA device.

``python -m tests.engines.vllm.block_outer_worker`` installs the device layer of
``fake_gpu.py`` (vLLM's platform is CUDA), applies kvshare's patches as the
``sitecustomize`` hook does, and then builds the KV cache as vLLM's engine core and worker
do, with FLASH_ATTN's layout rules (``FlashAttentionBackend.supported_kv_cache_layouts``):

1. the engine core's ``resolve_kv_cache_layout`` (patched: block-outer layouts first)
   picks the layout from FLASH_ATTN's supported set;
2. vLLM's planner lays out two full-attention layers whose 16-token block of all layers is
   exactly one page (``PAGE``, a run of the host backend's granules);
3. the model runner's ``allocate_kv_cache`` (patched: a rank server on the host backend)
   builds vLLM's own per-layer views with ``create_kv_cache_views``; the scheduler's
   ``KVCacheManager`` draws its blocks from the group's owner pool;
4. three requests take one block each; every layer's view of each block is written
   through vLLM's views, the middle request finishes, and the pool's maintenance unmaps
   its page while the other two are in use.

Prints one JSON line with what it saw; ``test_block_outer.py`` checks it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from tests.engines.vllm import fake_gpu
from tests.engines.vllm.kv_setup import BLOCK_TOKENS, LAYERS

PAGE = 16 * 2**10  # 16 tokens x 2 KV heads x 64 x fp16 x K and V x 2 layers: one block
VIRTUAL = 40 * PAGE  # 40 blocks: no other dimension of a view has that size


def _activate(scratch: Path) -> None:
    """kvshare active for vLLM on the host backend, pages of one block, a fixed lease."""
    from kvshare.api import env
    from kvshare.runtime.engines import pools
    from kvshare.runtime.engines.activation import activate
    from tests.runtime.support import MovableLease

    activate("vllm")
    for variable, value in (
        (env.BACKEND, "host"),
        (env.PAGE_SIZE, str(PAGE)),
        (env.KV_LIMIT, str(8 * PAGE)),
        (env.RESERVE_PAGES, "0"),
        (env.BROKER_SOCKET, str(scratch / "no-broker.sock")),
    ):
        os.environ[variable.name] = value
    pools.lease_for = lambda role: MovableLease(env.KV_LIMIT.require())  # type: ignore[assignment]


def build_and_check(scratch: Path) -> dict[str, object]:
    from kvshare.runtime.engines import pools, vllm_common
    from kvshare.runtime.rank_server import RankServer

    _activate(scratch)
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine import core
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.gpu import attn_utils

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # 0.30.x keeps the planner in kv_cache_utils
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    vllm_config = VllmConfig(device_config=DeviceConfig(device="cuda"))
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    supported = [x.name for x in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    layout = core.resolve_kv_cache_layout(vllm_config, [supported], [spec] * len(LAYERS))
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(LAYERS, spec)], VIRTUAL)
    config.kv_cache_layout = layout.name  # as the engine core records it
    group = vllm_common.Group(f"blockouter-{os.getpid()}", 1)
    with (
        vllm_common.worker_context(group, 0, supported, "FLASH_ATTN supports any layout"),
        fake_gpu.host_tensors(),
    ):
        views = attn_utils.allocate_kv_cache(config, torch.device("cuda:0"), layout, None)
    with vllm_common.scheduler_context(group, vllm_config.cache_config):
        manager = KVCacheManager(
            config,
            max_model_len=256,
            scheduler_block_size=BLOCK_TOKENS,
            hash_block_size=BLOCK_TOKENS,
            enable_caching=False,
        )
    rank = next(item for item in pools._opened if isinstance(item, RankServer))
    queue = manager.block_pool.free_block_queue
    pool = queue.pool
    requests = [_request(f"r{i}") for i in range(3)]
    blocks = []
    for req in requests:
        assert manager.allocate_slots(req, req.num_tokens, 0) is not None
        (block,) = manager.get_block_ids(req.request_id)[0]
        blocks.append(block)
    base = rank.space.block_address(0, 0)
    granules = {}  # every layer's view of each block: which page its bytes start in
    for n, block in enumerate(blocks):
        starts = set()
        for layer in LAYERS:
            view = _block_view(views[layer], block, config.num_blocks)
            view.view(torch.uint8).fill_(10 * (n + 1) + LAYERS.index(layer))
            first, last = view.data_ptr(), view.data_ptr() + _extent(view) - 1
            starts.add(((first - base) // PAGE, (last - base) // PAGE))
        granules[block] = sorted(starts)
    middle = blocks[1]
    manager.free(requests[1])
    pool.maintain()  # no reserve: the emptied page goes back to the device
    mapped = sorted(rank.mapped_pages())
    intact = {
        block: [
            int(_block_view(views[layer], block, config.num_blocks).view(torch.uint8).max())
            for layer in LAYERS
        ]
        for block in (blocks[0], blocks[2])
    }
    result = {
        "layout": layout.name,
        "rank_buffers": rank.geometry.num_buffers,
        "page_bytes": rank.geometry.page_bytes,
        "blocks_per_page": [len(rank.geometry.blocks_of(p)) for p in range(1, 4)],
        "paging": [rank.paging.layout, rank.paging.reason],
        "owner_page_bytes": pool.geometry.page_bytes,
        "blocks": blocks,
        "granules": {str(block): pages for block, pages in granules.items()},
        "middle_page": rank.geometry.page_of(middle),
        "mapped": mapped,
        "intact": {str(block): values for block, values in intact.items()},
    }
    pools.forget_pools()
    return result


def _block_view(view: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """Block ``block`` of a layer's view, whichever dimension vLLM put the blocks in."""
    dim = next(i for i, size in enumerate(view.shape) if size == num_blocks)
    return view.select(dim, block)


def _extent(view: torch.Tensor) -> int:
    """Bytes from a view's first element to just past its last one."""
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
    return (last + 1) * view.element_size()


def _request(request_id: str) -> object:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, BLOCK_TOKENS - 1)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def main() -> int:
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # up to 0.33: V2 needs Triton
    fake_gpu.install(fake_gpu.Gpu(total=80 * fake_gpu.GIB, held_by_others=0))
    with tempfile.TemporaryDirectory() as scratch:
        result = build_and_check(Path(scratch))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the rank server's threads need no orderly teardown here


if __name__ == "__main__":
    sys.exit(main())
