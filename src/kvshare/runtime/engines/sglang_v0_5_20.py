"""Patches for SGLang 0.5.20 (see :mod:`kvshare.runtime.engines.sglang_common`).

Differs from 0.5.23 in the scheduler's loop entry (``ingest_requests`` takes no
``stop_at_pause``) and keeps a scheduler's ranks on the scheduler; its paged allocator
always launches Triton kernels, so its paged allocation runs on GPUs only.
"""

from __future__ import annotations

from typing import Any

from kvshare.runtime.engines.sglang_common import sglang_patch_set


def _scheduler_rank(scheduler: Any) -> tuple[int, int]:
    """0.5.20 keeps the ranks in the scheduler's own parallel state (``Scheduler.ps``)."""
    return int(scheduler.ps.tp_rank), int(scheduler.ps.tp_size)


PATCHES = sglang_patch_set("0.5.20", ingest_parameters=("self",), scheduler_rank=_scheduler_rank)
