"""Patches for vLLM 0.30.x (see :mod:`kvshare.runtime.engines.vllm_common`).

Differs from 0.33.x in constructor parameters (no hash look-ahead, no external weight
memory in the start-up check) and in the kernel block size of MLA layers that have a
storage block size of their own.
"""

from __future__ import annotations

from typing import Any

from kvshare.runtime.engines.vllm_common import (
    ALLOCATE_SLOTS_PARAMETERS,
    BLOCK_POOL_PARAMETERS,
    COORDINATOR_PARAMETERS,
    group_kernel_block_size,
    vllm_patch_set,
)
from kvshare.runtime.engines.vllm_cpu_worker import cpu_worker_patches


def _kernel_block_size(
    spec: Any, group_id: int, kernel_block_sizes: list[int] | None
) -> int | None:
    """As 0.30's ``allocate_kv_cache``: an MLA storage block size wins over the group's."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec) and spec.storage_block_size is not None:
        return int(spec.storage_block_size)
    return group_kernel_block_size(spec, group_id, kernel_block_sizes)


PATCHES = vllm_patch_set(
    "0.30.x",
    coordinator_parameters=COORDINATOR_PARAMETERS,
    block_pool_parameters=(*BLOCK_POOL_PARAMETERS, "medium"),
    kernel_block_size=_kernel_block_size,
    allocate_slots_parameters=ALLOCATE_SLOTS_PARAMETERS,
    deferred=(cpu_worker_patches("0.30.x"),),
    request_memory_parameters=("init_snapshot", "cache_config"),
)
