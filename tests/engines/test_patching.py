"""Patch sets replace all their targets or none, and say precisely what moved."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvshare.runtime.engines.patching import Patch, PatchSet, PatchTargetError, Target, is_patched

MODULE = "kvshare_patching_subject"


class Subject:
    def compute(self, x: int, y: int) -> int:
        return x + y


def helper(value: int) -> int:
    return value * 2


@pytest.fixture
def subject() -> Iterator[types.ModuleType]:
    module = types.ModuleType(MODULE)
    module.Subject = type("Subject", (), {"compute": Subject.compute})  # type: ignore[attr-defined]
    module.helper = helper  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    yield module
    del sys.modules[MODULE]


def doubling(original: Any) -> Any:
    def wrapper(*args: Any) -> Any:
        return 2 * original(*args)

    return wrapper


def test_all_targets_are_replaced_once_and_keep_their_original(subject: Any) -> None:
    patches = PatchSet(
        "engine",
        "1.x",
        [
            Patch(Target(MODULE, "Subject.compute", ("self", "x", "y")), doubling, "doubled"),
            Patch(Target(MODULE, "helper", ("value",)), doubling, "doubled"),
        ],
    )
    patches.apply("1.2")
    patches.apply("1.2")
    assert subject.Subject().compute(1, 2) == 6
    assert subject.helper(3) == 12
    assert is_patched(subject.helper)
    assert subject.helper.__wrapped__ is helper
    assert patches.applied


def test_one_moved_target_leaves_every_target_untouched(subject: Any) -> None:
    patches = PatchSet(
        "engine",
        "1.x",
        [
            Patch(Target(MODULE, "helper", ("value",)), doubling, "doubled"),
            Patch(Target(MODULE, "Subject.compute", ("self", "x")), doubling, "doubled"),
        ],
        requires=[Target(MODULE, "Subject.vanished", ("self",))],
    )
    with pytest.raises(PatchTargetError) as info:
        patches.apply("1.3")
    message = str(info.value)
    assert "kvshare cannot patch engine 1.3 (patches for 1.x)" in message
    assert f"{MODULE}.Subject.compute: expected parameters (self, x), found (self, x, y)" in message
    assert f"{MODULE}.Subject.vanished: does not exist" in message
    assert subject.helper is helper
    assert not is_patched(subject.helper)
    assert not patches.applied


def test_a_missing_module_is_named() -> None:
    patches = PatchSet(
        "engine", "1.x", [Patch(Target("no_such_engine.core", "f", ()), doubling, "")]
    )
    with pytest.raises(
        PatchTargetError,
        match=r"no_such_engine\.core\.f: module no_such_engine\.core does not import",
    ):
        patches.check("1.0")
