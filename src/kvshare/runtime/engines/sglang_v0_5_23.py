"""Patches for SGLang 0.5.23 (see :mod:`kvshare.runtime.engines.sglang_common`)."""

from __future__ import annotations

from kvshare.runtime.engines.sglang_common import sglang_patch_set

PATCHES = sglang_patch_set("0.5.23", ingest_parameters=("self", "stop_at_pause"))
