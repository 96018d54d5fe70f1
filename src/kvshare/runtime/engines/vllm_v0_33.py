"""Patches for vLLM 0.33.x (see :mod:`kvshare.runtime.engines.vllm_common`).

Differs from 0.30.x in constructor parameters: block hashes look ahead past each block.
"""

from __future__ import annotations

from kvshare.runtime.engines.vllm_common import (
    ALLOCATE_SLOTS_PARAMETERS,
    BLOCK_POOL_PARAMETERS,
    COORDINATOR_PARAMETERS,
    group_kernel_block_size,
    vllm_patch_set,
)
from kvshare.runtime.engines.vllm_cpu_worker import cpu_worker_patches

PATCHES = vllm_patch_set(
    "0.33.x",
    coordinator_parameters=(*COORDINATOR_PARAMETERS, "num_hash_lookahead_tokens"),
    block_pool_parameters=(*BLOCK_POOL_PARAMETERS, "num_hash_lookahead_tokens", "medium"),
    kernel_block_size=group_kernel_block_size,
    allocate_slots_parameters=(*ALLOCATE_SLOTS_PARAMETERS, "skip_zeroing_group_ids"),
    deferred=(cpu_worker_patches("0.33.x"),),
)
