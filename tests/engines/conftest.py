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

from tests.engines.line_suites import ROOT, SUITE_VARIABLE, EngineSuites, Suite

#: Where the outer run keeps its :class:`EngineSuites`.
SUITES = pytest.StashKey[EngineSuites]()

collect_ignore = [] if os.environ.get(SUITE_VARIABLE) else ["vllm", "sglang"]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for unix sockets (paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _waits_for_the_suites(item: pytest.Item) -> bool:
    return item.path.name == "test_engine_suites.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Wait for the suites as late as the serving tests allow: the suites run in the
    background from the session's start, so every test before the wait runs beside them
    rather than after them. The serving tests come after it: their servers run at the
    suites' low priority and some of their checks are timed, so they keep the cores to
    themselves as before."""

    def place(item: pytest.Item) -> int:
        if _waits_for_the_suites(item):
            return 1
        return 2 if "serving" in item.path.relative_to(ROOT).parts[:2] else 0

    if any(map(_waits_for_the_suites, items)):
        items.sort(key=place)  # stable: each part keeps its own order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the suites as soon as the session knows it runs them: they run beside the
    rest of the session (see ``line_suites.SUITE_NICENESS``)."""
    if not os.environ.get(SUITE_VARIABLE) and any(map(_waits_for_the_suites, session.items)):
        session.config.stash[SUITES] = EngineSuites()


def pytest_sessionfinish(session: pytest.Session) -> None:
    suites = session.config.stash.get(SUITES, None)
    if suites is not None:
        suites.close()


@pytest.fixture(scope="session")
def suites(pytestconfig: pytest.Config) -> dict[str, Suite]:
    """The suite of every supported line, started (at the latest) now."""
    if SUITES not in pytestconfig.stash:
        pytestconfig.stash[SUITES] = EngineSuites()
    return pytestconfig.stash[SUITES].started
