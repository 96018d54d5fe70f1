"""Checked, all-or-nothing patches of an engine's functions and methods.

A :class:`Patch` names its target (module, attribute path, expected parameters) and how
to build the replacement from the original. A :class:`PatchSet` imports every target,
checks that each exists with the expected parameters, and only then replaces them all:
an engine is either fully patched or not touched, and a target that moved fails start-up
with a :class:`PatchTargetError` naming the engine version and the target.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Patch", "PatchSet", "PatchTargetError", "Target", "is_patched"]

AnyCallable = Callable[..., Any]
#: Builds the replacement from the original callable.
Wrapper = Callable[[AnyCallable], AnyCallable]

_MARK = "__kvshare_patch__"


class PatchTargetError(RuntimeError):
    """A patch target is missing or its signature differs from the one the patch expects."""


@dataclass(frozen=True)
class Target:
    """A function or method of the engine, and the parameters the patch relies on."""

    module: str
    """Module to import (``vllm.v1.core.kv_cache_coordinator``)."""
    attribute: str
    """Attribute path inside the module (``KVCacheCoordinator.__init__``)."""
    parameters: tuple[str, ...]
    """Parameter names in order, ``self`` included for methods."""

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True)
class Patch:
    """One target and the wrapper that replaces it."""

    target: Target
    wrap: Wrapper
    why: str
    """What the patch changes, for logs and docs/engines.md."""


@dataclass(frozen=True)
class _Resolved:
    patch: Patch
    owner: object
    name: str
    original: AnyCallable


def is_patched(value: object) -> bool:
    """Whether ``value`` is a replacement installed by a :class:`PatchSet`."""
    return getattr(value, _MARK, None) is not None


def _resolve(target: Target) -> tuple[object, str, AnyCallable]:
    """Import the target's module and walk to the attribute; raise a plain message."""
    try:
        owner: object = importlib.import_module(target.module)
    except ImportError as exc:
        raise LookupError(f"module {target.module} does not import ({exc})") from exc
    *path, name = target.attribute.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise LookupError(f"{target.module} has no {part}")
        owner = getattr(owner, part)
    value = inspect.getattr_static(owner, name, None)
    if value is None:
        raise LookupError("does not exist")
    if isinstance(value, staticmethod | classmethod):
        raise LookupError(f"{target} is a {type(value).__name__}, expected a function")
    if not callable(value):
        raise LookupError(f"{target} is not callable")
    return owner, name, value


def _check(target: Target) -> tuple[object, str, AnyCallable]:
    """Resolve ``target`` and compare its parameters with the expected ones."""
    owner, name, original = _resolve(target)
    current = inspect.unwrap(original) if is_patched(original) else original
    try:
        found = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError) as exc:
        raise LookupError(f"signature unreadable ({exc})") from exc
    if found != target.parameters:
        raise LookupError(
            f"expected parameters ({', '.join(target.parameters)}), found ({', '.join(found)})"
        )
    return owner, name, original


class PatchSet:
    """The patches of one engine line. :meth:`apply` is idempotent and all-or-nothing."""

    def __init__(
        self,
        engine: str,
        line: str,
        patches: Sequence[Patch],
        requires: Sequence[Target] = (),
    ) -> None:
        self.engine = engine
        self.line = line
        self.patches = tuple(patches)
        self.requires = tuple(requires)
        """Engine functions the patches call or rely on without replacing them."""
        self._lock = threading.Lock()  # guards _applied: imports may race across threads
        self._applied: list[_Resolved] = []

    @property
    def targets(self) -> tuple[Target, ...]:
        """Every replaced target, in application order."""
        return tuple(patch.target for patch in self.patches)

    def check(self, version: str) -> list[_Resolved]:
        """Import and check every target and requirement; one error lists every mismatch."""
        resolved: list[_Resolved] = []
        problems: list[str] = []
        for target in self.requires:
            try:
                _check(target)
            except LookupError as exc:
                problems.append(f"{target}: {exc}")
        for patch in self.patches:
            try:
                owner, name, original = _check(patch.target)
            except LookupError as exc:
                problems.append(f"{patch.target}: {exc}")
                continue
            resolved.append(_Resolved(patch, owner, name, original))
        if problems:
            raise PatchTargetError(
                f"kvshare cannot patch {self.engine} {version} (patches for {self.line}): "
                + "; ".join(problems)
                + ". Nothing was patched; use a supported engine version or unset "
                "KVSHARE_ENABLE."
            )
        return resolved

    def apply(self, version: str) -> None:
        """Check every target, then replace them all (nothing when already applied)."""
        with self._lock:
            if self._applied:
                return
            resolved = self.check(version)
            for item in resolved:
                if is_patched(item.original):
                    continue
                replacement = item.patch.wrap(item.original)
                functools.update_wrapper(replacement, item.original)
                setattr(replacement, _MARK, item.patch.target)
                setattr(item.owner, item.name, replacement)
            self._applied = resolved
        log.info(
            "kvshare patched %s %s: %d targets (%s)",
            self.engine,
            version,
            len(resolved),
            ", ".join(str(item.patch.target) for item in resolved),
        )

    @property
    def applied(self) -> bool:
        """Whether :meth:`apply` has run in this process."""
        return bool(self._applied)
