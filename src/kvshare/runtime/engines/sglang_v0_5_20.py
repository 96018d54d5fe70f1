"""Patches for SGLang 0.5.20 (see :mod:`kvshare.runtime.engines.sglang_common`).

Differs from 0.5.23 in the scheduler's loop entry (``ingest_requests`` takes no
``stop_at_pause``); its paged allocator always launches Triton kernels, so its paged
allocation runs on GPUs only.
"""

from __future__ import annotations

from kvshare.runtime.engines.sglang_common import sglang_patch_set

PATCHES = sglang_patch_set("0.5.20", ingest_parameters=("self",))
