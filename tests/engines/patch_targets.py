"""Checks of the patch table that every engine suite runs (imported into each suite).

Each suite's conftest provides ``engine`` (``vllm``/``sglang``), ``line`` (the support
line of the installed version) and ``moved_target`` (a real target with a wrong
parameter list, as if the engine had changed it).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from kvshare.api.engines import SupportedLine
from kvshare.runtime.engines.activation import activate, engine_version
from kvshare.runtime.engines.patching import Patch, PatchSet, PatchTargetError, Target, is_patched


def patch_set(line: SupportedLine) -> PatchSet:
    module = importlib.import_module(f"kvshare.runtime.engines.{line.patch_module}")
    patches: PatchSet = module.PATCHES
    return patches


def resolve(target: Target) -> object:
    owner: object = importlib.import_module(target.module)
    for part in target.attribute.split("."):
        owner = getattr(owner, part)
    return owner


def test_every_target_and_requirement_matches_the_installed_engine(
    engine: str, line: SupportedLine
) -> None:
    patches = patch_set(line)
    resolved = patches.check(engine_version(engine))
    assert len(resolved) == len(patches.patches)
    for target in (*patches.targets, *patches.requires):
        found = inspect.unwrap(resolve(target))
        assert tuple(inspect.signature(found).parameters) == target.parameters, target


def test_a_moved_target_fails_naming_the_version_and_patches_nothing(
    engine: str, line: SupportedLine, moved_target: Target
) -> None:
    real = patch_set(line)
    missing = Target(moved_target.module, "allocate_from_nowhere", ("self",))
    broken = PatchSet(
        engine,
        real.line,
        [*real.patches[:2], Patch(moved_target, real.patches[0].wrap, "moved")],
        requires=[missing],
    )
    before = [resolve(target) for target in real.targets[:2]]
    with pytest.raises(PatchTargetError) as info:
        broken.apply(engine_version(engine))
    message = str(info.value)
    assert f"{engine} {engine_version(engine)}" in message
    assert f"{moved_target}: expected parameters ({', '.join(moved_target.parameters)})" in message
    assert f"{moved_target.module}.allocate_from_nowhere: does not exist" in message
    assert [resolve(target) for target in real.targets[:2]] == before
    assert not broken.applied


def test_activation_replaces_every_target_once(engine: str, line: SupportedLine) -> None:
    assert activate(engine) == line
    first = [resolve(target) for target in patch_set(line).targets]
    assert all(is_patched(value) for value in first)
    activate(engine)
    assert [resolve(target) for target in patch_set(line).targets] == first
