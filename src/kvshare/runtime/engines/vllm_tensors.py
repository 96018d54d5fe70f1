"""vLLM's KV cache tensors over a kvshare pool: the pool geometry that mirrors vLLM's
layout, and the per-layer views vLLM's own ``create_kv_cache_views`` builds over it.

One :class:`~kvshare.runtime.rank_server.RankServer` per worker serves its device's
memory; the scheduler's pool (:mod:`.vllm_common`) plans the same geometry from the same
KV cache config, so block ids mean the same bytes on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.patching import AnyCallable
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.engines.vllm_groups import current_worker
from kvshare.runtime.engines.vllm_layout import explain, requested_layout
from kvshare.runtime.paging import Paging, block_outer_page_size, tiling_advice

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.geometry import KVGeometry

__all__ = [
    "KernelBlockSize",
    "PoolPlan",
    "allocating_from_pool",
    "group_kernel_block_size",
    "plan_pool",
]

log = logging.getLogger(__name__)

#: Picks the kernel block size of one tensor's views, as the line's ``allocate_kv_cache`` does.
KernelBlockSize = Callable[[Any, int, "list[int] | None"], "int | None"]


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The pool geometry for a vLLM KV cache config, and its tensors placed in that pool."""

    geometry: KVGeometry
    tensors: tuple[Any, ...]
    """vLLM ``KVCacheTensor``s with offsets and layer strides in the pool's range."""


def plan_pool(kv_cache_config: Any, layout: Any) -> PoolPlan:
    """Mirror vLLM's layout in a pool geometry (the scheduler and workers agree on it).

    Layer-outer layouts (``L`` then ``B`` outermost) keep each layer's blocks in one run:
    one pool buffer per layer, the layer stride becomes the pool's page-aligned buffer
    stride, and a page is one granule (``KVSHARE_PAGE_SIZE``) of every layer. Block-outer
    layouts keep all layers of a block in one packed run: one pool buffer of packed
    blocks, nothing moves, and a page is the smallest run of granules holding whole
    blocks (:func:`~kvshare.runtime.paging.block_outer_page_size`). Other layouts split a
    block across a layer's region and are refused.
    """
    from kvshare.runtime.geometry import KVGeometry

    tensors = tuple(kv_cache_config.kv_cache_tensors)
    num_blocks = kv_cache_config.num_blocks
    strides = {tensor.block_stride for tensor in tensors}
    sizes = {tensor.size for tensor in tensors}
    if len(strides) != 1 or len(sizes) != 1:
        raise EngineConfigError(
            "kvshare needs one block stride and one backing allocation for every KV cache "
            f"tensor; this model has block strides {sorted(strides)} (hybrid page sizes)"
        )
    block_stride, raw_size = strides.pop(), sizes.pop()
    if layout.is_block_outermost:
        page = block_outer_page_size(block_stride, pools.page_size())
        return PoolPlan(KVGeometry(1, block_stride, num_blocks, page), tensors)
    if not layout.is_block_compact:
        raise EngineConfigError(
            f"kvshare cannot page vLLM's KV cache layout {layout.name}: a block is not one "
            "contiguous run per layer; set VLLM_KV_CACHE_LAYOUT to a layer- or block-outer "
            "layout (e.g. LBHNC or BLHNC)"
        )
    layer_bytes = block_stride * num_blocks
    if raw_size % layer_bytes or any(tensor.offset % layer_bytes for tensor in tensors):
        raise EngineConfigError(
            f"vLLM's KV cache tensors are not whole layers of {layer_bytes} bytes; "
            "kvshare cannot page this layout"
        )
    geometry = KVGeometry(
        raw_size // layer_bytes, block_stride, num_blocks, pools.page_size(), "per-layer"
    )
    placed = tuple(
        dataclasses.replace(
            tensor,
            size=geometry.virtual_bytes,
            offset=tensor.offset // layer_bytes * geometry.buffer_stride,
            layer_stride=geometry.buffer_stride,
        )
        for tensor in tensors
    )
    return PoolPlan(geometry, placed)


def group_kernel_block_size(
    spec: Any, group_id: int, kernel_block_sizes: list[int] | None
) -> int | None:
    """The kernel block size of a group's views, when the model runner chose one."""
    del spec
    if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
        return kernel_block_sizes[group_id]
    return None


def allocating_from_pool(
    kernel_block_size: KernelBlockSize,
) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for ``allocate_kv_cache``: the same views, over the pool's range."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def allocate_kv_cache(
            kv_cache_config: Any,
            device: torch.device,
            layout: Any,
            kernel_block_sizes: list[int] | None = None,
            allocate: Callable[[int], torch.Tensor] | None = None,
        ) -> dict[str, torch.Tensor]:
            if not kv_cache_config.kv_cache_tensors:
                own = {} if allocate is None else {"allocate": allocate}
                return original(kv_cache_config, device, layout, kernel_block_sizes, **own)  # type: ignore[no-any-return]
            if allocate is not None:
                raise EngineConfigError(
                    "vLLM backs its KV cache with an allocator of its own (its extensible KV "
                    "cache); with kvshare the pool is the KV allocation: start vLLM with "
                    "--no-enable-extensible-kv-cache"
                )
            context = current_worker()
            if context is None:
                raise EngineConfigError(
                    "vLLM allocated a KV cache outside a worker's initialize_from_config; "
                    "kvshare cannot tell which engine it belongs to"
                )
            plan = plan_pool(kv_cache_config, layout)
            paging = _paging(kv_cache_config, layout, context.supported_layouts, context.backends)
            server = pools.open_rank(
                plan.geometry, device, context.role, context.group.name, paging=paging
            )
            raw = server.tensor(0, plan.geometry.num_buffers).view(_int8())
            return _views(
                raw,
                kv_cache_config,
                plan,
                layout=layout,
                kernel_block_sizes=kernel_block_sizes,
                kernel_block_size=kernel_block_size,
            )

        return allocate_kv_cache

    return wrap


def _paging(kv_cache_config: Any, layout: Any, supported: tuple[str, ...], backends: str) -> Paging:
    """What the worker's pages hold and why, said once in the log; a block that does not
    tile the granule is said with its waste and the block size that would not waste."""
    paging = explain(
        layout.name,
        supported or (layout.name,),
        several_groups=len(kv_cache_config.kv_cache_groups) > 1,
        requested=requested_layout(),
        detail=backends,
    )
    log.info("kvshare: vLLM's KV cache layout %s gives %s", layout.name, paging.describe())
    if paging.layout == "block-outer":
        tensor = kv_cache_config.kv_cache_tensors[0]
        tokens = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        advice = tiling_advice(tensor.block_stride, tokens, pools.page_size())
        if advice is not None:
            log.warning("kvshare: %s", advice)
    return paging


def _int8() -> torch.dtype:
    import torch

    return torch.int8


def _views(
    raw: torch.Tensor,
    kv_cache_config: Any,
    plan: PoolPlan,
    *,
    layout: Any,
    kernel_block_sizes: list[int] | None,
    kernel_block_size: KernelBlockSize,
) -> dict[str, torch.Tensor]:
    """Per-layer views built by vLLM's ``create_kv_cache_views``, as vLLM lays them out."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in plan.tensors:
        layer_name = tensor.layers[0]
        group_id, group = next(
            (group_id, group)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
            if layer_name in group.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        if not spec.has_layer_views:
            raise EngineConfigError(
                f"layer {layer_name} keeps {type(spec).__name__} state that lays out its own "
                "storage; kvshare pages attention KV caches only"
            )
        views = create_kv_cache_views(
            raw,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size(spec, group_id, kernel_block_sizes),
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches
