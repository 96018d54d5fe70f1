"""Import hooks that patch vLLM or SGLang right after the engine package loads.

:func:`install_from_env` (called by the bundle's ``sitecustomize``) does nothing unless
``KVSHARE_ENABLE=1``. Otherwise it puts :class:`EngineImportHook` first on
``sys.meta_path``. The hook imports nothing itself: when the process later imports
``vllm`` or ``sglang``, the hook wraps that package's loader; right after the package has
executed, it looks the installed version up in the support table, imports the line's
patch module and applies its patches. An unsupported version or a moved target makes the
engine's import fail, naming the version: an engine never serves without kvshare when
kvshare was asked for. A line's deferred sets (:class:`~.patching.Deferred`) wait for the
engine to import their trigger module, and the hook applies them right after it has run
(or at once, when it already has).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvshare.api import env
from kvshare.api.engines import ENGINES, SupportedLine
from kvshare.runtime.engines.patching import Deferred
from kvshare.runtime.engines.registry import patches_for

log = logging.getLogger(__name__)

__all__ = ["EngineImportHook", "activated_lines", "engine_version", "install", "install_from_env"]

_lock = threading.Lock()  # guards _activated and _pending
_activated: dict[str, SupportedLine] = {}
#: Trigger module -> the deferred set waiting for the engine to import it, and the version.
_pending: dict[str, tuple[Deferred, str]] = {}


def engine_version(engine: str, module: ModuleType | None = None) -> str:
    """The installed version of ``engine``: its distribution metadata, else ``__version__``."""
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(module, "__version__", None)
        if isinstance(version, str):
            return version
        raise


def activate(engine: str, module: ModuleType | None = None) -> SupportedLine:
    """Patch ``engine`` (already imported) for its installed version; idempotent."""
    version = engine_version(engine, module)
    line, patches = patches_for(engine, version)
    patches.apply(version)
    with _lock:
        _activated[engine] = line
    for deferred in patches.deferred:
        _defer(deferred, version)
    return line


def _defer(deferred: Deferred, version: str) -> None:
    """Apply ``deferred`` now if the engine has imported its trigger, else when it does."""
    if deferred.trigger in sys.modules:
        deferred.patches.apply(version)
        return
    with _lock:
        _pending[deferred.trigger] = (deferred, version)
    if not any(isinstance(finder, EngineImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, EngineImportHook())


def _apply_deferred(trigger: str) -> None:
    with _lock:
        waiting = _pending.pop(trigger, None)
    if waiting is not None:
        deferred, version = waiting
        deferred.patches.apply(version)


def activated_lines() -> dict[str, SupportedLine]:
    """Engines patched in this process, with their support line."""
    with _lock:
        return dict(_activated)


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then applies kvshare's patches: an engine package's
    line, or a deferred set waiting for this module."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        if self._name in ENGINES:
            activate(self._name, module)
        else:
            _apply_deferred(self._name)

    def __getattr__(self, name: str) -> Any:
        # Resource readers, get_data, is_package ... come from the wrapped loader.
        return getattr(self._inner, name)


class EngineImportHook(importlib.abc.MetaPathFinder):
    """Finds ``vllm``/``sglang`` (and the triggers of deferred sets) through the other
    finders and wraps their loader."""

    def __init__(self, engines: Sequence[str] = ENGINES) -> None:
        self._engines = frozenset(engines)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._engines:
            with _lock:
                if fullname not in _pending:
                    return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, EngineImportHook):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
            return spec
        return None


def _show_logs() -> None:
    """Send kvshare's log lines to stderr beside the engine's (``KVSHARE_LOG_LEVEL``)."""
    logger = logging.getLogger("kvshare")
    logger.setLevel(env.LOG_LEVEL.require())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # the engine's root handlers would print every line twice


def install() -> EngineImportHook:
    """Put the import hook first on ``sys.meta_path`` (once); patch engines already imported."""
    _show_logs()
    for finder in sys.meta_path:
        if isinstance(finder, EngineImportHook):
            return finder
    hook = EngineImportHook()
    sys.meta_path.insert(0, hook)
    for engine in ENGINES:
        module = sys.modules.get(engine)
        if module is not None:
            activate(engine, module)
    return hook


def install_from_env() -> EngineImportHook | None:
    """:func:`install` when ``KVSHARE_ENABLE=1``, else nothing (and nothing is imported)."""
    if not env.ENABLE.read():
        return None
    return install()
