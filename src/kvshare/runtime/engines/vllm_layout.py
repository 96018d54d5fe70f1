"""Which KV cache layout kvshare asks vLLM for, and why a pool pages per layer.

vLLM (>= 0.29) resolves one KV cache layout in its engine core
(``vllm.v1.attention.backends.utils.resolve_kv_cache_layout``): ``VLLM_KV_CACHE_LAYOUT``
if every attention backend in use supports it, else the KV connector's, else the first of
the layouts every backend supports, in the workers' order of preference — ``LBNHC``
(layer-outer) first when the backends declare nothing. kvshare pages a block-outer layout
(``BLNHC``/``BLHNC``: all layers of one block together) by the block, and a layer-outer one
by a granule of every layer (:mod:`kvshare.runtime.paging`).

With ``KVSHARE_LAYOUT`` ``auto`` (the default) or ``block-outer``, the engine core's
resolution (:func:`asking_for_block_outer`) sees the workers' supported layouts with the
block-outer ones first, so vLLM's own rules pick a block-outer layout exactly when every
backend in use supports one; an explicit ``VLLM_KV_CACHE_LAYOUT`` and a connector's layout
still win. kvshare asks only for models with one KV cache group: a hybrid model's groups
share blocks of different shapes. ``block-outer`` makes start-up fail when vLLM resolves
anything else; ``per-layer`` leaves vLLM's own order alone.

Which backends support what, per line, is read from each backend's
``supported_kv_cache_layouts`` (``None``: any layout): FLASH_ATTN, TRITON_ATTN and most MLA
backends accept any; FlashInfer any up to 0.33 and the four it names (``LBNHC``, ``LBHNC``,
``BLNHC``, ``BLHNC``) in 0.34 (``LBHNC``/``BLHNC`` on sm100); FlexAttention, hpc_attn,
turboquant, the ROCm backends and ``CPU_ATTN`` (vLLM's CPU build:
``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackend.supported_kv_cache_layouts``
returns ``(LBHNC,)`` on every supported line) are layer-outer only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvshare.api import env
from kvshare.runtime.engines.patching import AnyCallable
from kvshare.runtime.engines.pools import EngineConfigError
from kvshare.runtime.paging import Paging

__all__ = [
    "asking_for_block_outer",
    "block_outer_first",
    "explain",
    "is_block_outer",
    "requested_layout",
    "worker_layout_facts",
]

log = logging.getLogger(__name__)

#: vLLM's block-outer layouts (B outermost), in vLLM's own order of preference.
_BLOCK_OUTER = ("BLNHC", "BLHNC", "BHLNC")


def is_block_outer(name: str) -> bool:
    """Whether the vLLM layout ``name`` keeps all layers of a block together."""
    return name in _BLOCK_OUTER


def block_outer_first(names: Sequence[str]) -> list[str]:
    """``names`` (most preferred first) with the block-outer layouts moved to the front,
    each group keeping its order."""
    return [n for n in names if is_block_outer(n)] + [n for n in names if not is_block_outer(n)]


def _several_groups(specs: Sequence[Any]) -> bool:
    """Whether the layers' KV cache specs make more than one KV cache group."""
    return any(spec != specs[0] for spec in specs[1:])


def explain(
    resolved: str,
    supported: Sequence[str],
    *,
    several_groups: bool,
    requested: str | None,
    detail: str = "",
) -> Paging:
    """What the pool's pages hold under the resolved layout, and why not whole blocks.

    ``supported``: the layouts every attention backend in use supports; ``requested``:
    ``VLLM_KV_CACHE_LAYOUT`` if set; ``detail``: the backends in the engine's words.
    """
    if is_block_outer(resolved):
        return Paging("block-outer")
    if env.LAYOUT.require() == "per-layer":
        return Paging("per-layer", "setting", f"vLLM resolved {resolved}")
    if requested is not None:
        return Paging("per-layer", "engine-setting", f"VLLM_KV_CACHE_LAYOUT={requested}")
    if not any(is_block_outer(name) for name in supported):
        backends = detail or f"they support {', '.join(supported)}"
        return Paging("per-layer", "backend", backends)
    if several_groups:
        return Paging("per-layer", "model", f"vLLM resolved {resolved}")
    return Paging("per-layer", "connector", f"vLLM resolved {resolved}")


def requested_layout() -> str | None:
    """``VLLM_KV_CACHE_LAYOUT`` as vLLM reads it (``None`` when unset)."""
    import vllm.envs

    requested = vllm.envs.VLLM_KV_CACHE_LAYOUT
    return str(requested) if requested is not None else None


def asking_for_block_outer(original: AnyCallable) -> AnyCallable:
    """Wrapper for the engine core's ``resolve_kv_cache_layout``: vLLM resolves as always,
    from the workers' supported layouts with the block-outer ones first (unless
    ``KVSHARE_LAYOUT=per-layer`` or the model has several KV cache groups). Under
    ``KVSHARE_LAYOUT=block-outer`` anything else fails start-up, saying why."""

    def resolve_kv_cache_layout(
        vllm_config: Any,
        supported_layouts: list[list[str]],
        kv_cache_specs: Iterable[Any] | None = None,
    ) -> Any:
        setting = env.LAYOUT.require()
        specs = [spec for spec in kv_cache_specs or () if getattr(spec, "has_layer_views", True)]
        several = _several_groups(specs)
        ordered = supported_layouts
        if setting != "per-layer" and not several:
            ordered = [block_outer_first(names) for names in supported_layouts]
        layout = original(vllm_config, ordered, kv_cache_specs)
        paging = explain(
            layout.name,
            supported_layouts[0] if supported_layouts else (),
            several_groups=several,
            requested=requested_layout(),
        )
        if setting == "block-outer" and paging.layout != "block-outer":
            raise EngineConfigError(
                f"KVSHARE_LAYOUT=block-outer, but vLLM resolved the KV cache layout "
                f"{layout.name}: {paging.describe()}; use KVSHARE_LAYOUT=auto to page "
                "per layer instead"
            )
        log.info("kvshare: vLLM's KV cache layout %s gives %s", layout.name, paging.describe())
        return layout

    return resolve_kv_cache_layout


def worker_layout_facts(worker: Any) -> tuple[list[str], str]:
    """The layouts every attention backend of ``worker`` supports (vLLM's own
    ``Worker.get_supported_kv_cache_layouts``), and those backends in vLLM's words."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    supported = list(worker.get_supported_kv_cache_layouts())
    named = []
    for backend in get_current_attn_backends(worker.vllm_config):
        layouts = backend.supported_kv_cache_layouts()
        accepts = "any layout" if layouts is None else "/".join(x.name for x in layouts)
        named.append(f"{backend.get_name()} supports {accepts}")
    return supported, "; ".join(dict.fromkeys(named))
