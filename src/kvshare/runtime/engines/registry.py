"""The patch set that serves the engine in this process, looked up in the support table.

The table itself (:data:`kvshare.api.engines.SUPPORTED`) lives in ``kvshare.api`` so that
the operator refuses the same versions the runtime refuses; each entry names its patch
module here, and this module imports it.
"""

from __future__ import annotations

import importlib

from kvshare.api.engines import SupportedLine, find_line
from kvshare.runtime.engines.patching import PatchSet

__all__ = ["patch_set", "patches_for"]


def patch_set(line: SupportedLine) -> PatchSet:
    """The patch set of one support line (imports its module, not the engine)."""
    module = importlib.import_module(f"kvshare.runtime.engines.{line.patch_module}")
    patches: PatchSet = module.PATCHES
    return patches


def patches_for(engine: str, version: str) -> tuple[SupportedLine, PatchSet]:
    """The support line and patch set for ``engine`` at ``version``.

    Raises :class:`~kvshare.api.engines.UnsupportedEngineVersionError`, listing the
    supported versions, when kvshare has none.
    """
    line = find_line(engine, version)
    return line, patch_set(line)
