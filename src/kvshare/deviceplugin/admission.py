"""What a pool's hello must satisfy to be admitted, and why it was not.

Reasons start with a label (``version``, ``gpu``, ``policy``, ``fit``) before ``:``; the
metrics count refusals by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.api.wire import PROTOCOL_VERSION, Hello
from kvshare.deviceplugin.records import GpuRecord, size

__all__ = ["MAX_PRIORITY", "hello_problem", "no_fit"]

MAX_PRIORITY = 1000


def hello_problem(hello: Hello, gpu: GpuRecord | None, known: Sequence[str]) -> str | None:
    """Why ``hello`` cannot be admitted on ``gpu`` (None: unknown GPU; ``known`` names the
    node's GPUs), fit aside; None when nothing is wrong with it."""
    if hello.version != PROTOCOL_VERSION:
        return (
            f"version: protocol version {hello.version} is not supported (this broker "
            f"speaks {PROTOCOL_VERSION}); run matching kvshare versions"
        )
    if gpu is None:
        return (
            f"gpu: unknown GPU {hello.gpu!r}; this node has {', '.join(known)} "
            "(KVSHARE_GPU_UUIDS must name GPUs of this node)"
        )
    if hello.page_size <= 0 or hello.page_size % 4096:
        return f"policy: page size {hello.page_size} is not a positive multiple of 4096"
    if min(hello.kv_min, hello.static, hello.held, hello.used, hello.lease, hello.rank) < 0:
        return "policy: sizes and rank must be >= 0"
    if hello.tp_size < 1:
        return "policy: tensor-parallel size must be >= 1"
    if hello.kv_max is not None and hello.kv_max < hello.kv_min:
        return f"policy: kv max {size(hello.kv_max)} is below kv min {size(hello.kv_min)}"
    if not 0 <= hello.priority <= MAX_PRIORITY:
        return f"policy: priority {hello.priority} is outside 0-{MAX_PRIORITY}"
    return None


def no_fit(gpu: GpuRecord, static: int, kv_min: int) -> str:
    """Why an engine of ``static`` + ``kv_min`` bytes does not fit on ``gpu``."""
    return (
        f"fit: static {size(static)} + kv min {size(kv_min)} does not fit on GPU "
        f"{gpu.info.index} ({gpu.info.uuid}): {size(max(gpu.placement_free, 0))} left "
        f"of {size(gpu.info.total_bytes)} (headroom {size(gpu.headroom)}, static "
        f"{size(gpu.static_sum + gpu.expected_static)} and kv min "
        f"{size(gpu.min_sum + gpu.expected_min)} committed to {len(gpu.pools)} pool(s)); "
        "lower kvCache.min or place the model on another GPU"
    )
