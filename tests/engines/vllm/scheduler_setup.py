"""vLLM's own scheduler over a patched KV cache, built as vLLM's ``EngineCore`` builds it.

The worker's side is a rank server on the ``host`` backend (vLLM's ``allocate_kv_cache``,
patched, in the worker's group); the scheduler's block pool is the owner pool of the same
group. Tests drive the scheduler as the engine core does: ``add_request``, ``schedule``,
``update_from_output`` with model outputs they make up.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

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
    kv_cache_config,
    model_config,
)

STOP = 7  # the stop token of every request


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


@contextmanager
def scheduled_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, asynchronous: bool, prefix_caching: bool
) -> Iterator[Engine]:
    """A worker's KV cache and vLLM's scheduler (its ``AsyncScheduler`` if
    ``asynchronous``), grouped as vLLM groups them; the pools are forgotten on exit."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker import gpu_model_runner

    activate("vllm")
    standalone_host_pools(
        monkeypatch, tmp_path, page_size=PAGE, lease=LEASE_PAGES * len(LAYERS) * PAGE
    )
    kv_config, layout = kv_cache_config(VIRTUAL)
    config = VllmConfig(
        model_config=model_config(tmp_path),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=prefix_caching),
    )
    # Unique across processes: the group names the rank's socket in the abstract namespace,
    # which the engine suites of every vLLM line, run at once, share (vLLM's own instance
    # ids are random for the same reason).
    config.instance_id = f"sched-{uuid.uuid4().hex[:16]}"
    config.cache_config.kv_cache_layout = "LBHNC"  # as kv_cache_config lays it out
    config.scheduler_config.async_scheduling = asynchronous
    config.cache_config.num_gpu_blocks = kv_config.num_blocks  # as EngineCore sets it
    with vllm_common.worker_context(vllm_common.group_of(config), 0):
        kv_caches = gpu_model_runner.allocate_kv_cache(kv_config, torch.device("cpu"), layout, None)
    scheduler = (AsyncScheduler if asynchronous else Scheduler)(
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


def request(request_id: str, tokens: int, max_tokens: int = 8) -> Any:
    """A vLLM request of a ``tokens``-long prompt (its ids drawn from ``request_id``) with
    vLLM's own block hasher, ending at :data:`STOP` or after ``max_tokens``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=[(ord(request_id) * 97 + i) % 4000 for i in range(tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP]),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256),
    )


def output(tokens: dict[str, int]) -> Any:
    """A step's model output: one sampled token per request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=[[tokens[rid]] for rid in ids],
    )
