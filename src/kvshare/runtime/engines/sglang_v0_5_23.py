"""Patches for SGLang 0.5.23 (see :mod:`kvshare.runtime.engines.sglang_common`)."""

from __future__ import annotations

from typing import Any

from kvshare.runtime.engines.sglang_common import sglang_patch_set


def _scheduler_rank(scheduler: Any) -> tuple[int, int]:
    """0.5.23 publishes the process's ranks in its runtime context before the scheduler."""
    from sglang.srt.runtime_context import get_parallel

    del scheduler
    parallel = get_parallel()
    return int(parallel.tp_rank), int(parallel.tp_size)


PATCHES = sglang_patch_set(
    "0.5.23", ingest_parameters=("self", "stop_at_pause"), scheduler_rank=_scheduler_rank
)
