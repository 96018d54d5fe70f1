"""Engine tests run against the real vLLM and SGLang packages, one interpreter per version.

Two versions of one engine cannot share a process, so the suites in ``vllm/`` and
``sglang/`` run in a subprocess per supported line (see ``test_engine_suites.py``), with
that line's environment from ``tools/engine_env.py`` on ``PYTHONPATH`` and
``KVSHARE_ENGINE_SUITE`` naming it. The outer run collects only the modules at this level.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SUITE_VARIABLE = "KVSHARE_ENGINE_SUITE"

collect_ignore = [] if os.environ.get(SUITE_VARIABLE) else ["vllm", "sglang"]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for unix sockets (paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
