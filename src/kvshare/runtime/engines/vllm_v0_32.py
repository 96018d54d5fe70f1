"""Patches for vLLM 0.32.x (see :mod:`kvshare.runtime.engines.vllm_common`).

The constructor parameters of 0.30.x (no hash look-ahead) with the kernel block size of
0.33.x (the group's, MLA layers included).
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
    "0.32.x",
    coordinator_parameters=COORDINATOR_PARAMETERS,
    block_pool_parameters=(*BLOCK_POOL_PARAMETERS, "medium"),
    kernel_block_size=group_kernel_block_size,
    allocate_slots_parameters=(*ALLOCATE_SLOTS_PARAMETERS, "skip_zeroing_group_ids"),
    deferred=(cpu_worker_patches("0.32.x"),),
)
