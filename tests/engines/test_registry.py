"""The support table: which versions run, which are refused, and one table everywhere."""

from __future__ import annotations

import pytest
from tools import engine_env

from kvshare.api.engines import (
    SUPPORTED,
    UnsupportedEngineVersionError,
    find_line,
    parse_release,
)


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.33.1+cu130", (0, 33, 1)), ("v0.5.23.post1", (0, 5, 23)), ("0.30.0rc2", (0, 30, 0))],
)
def test_releases_parse_without_local_or_pre_parts(version: str, release: tuple[int, ...]) -> None:
    assert parse_release(version) == release


@pytest.mark.parametrize(
    ("engine", "version", "module"),
    [
        ("vllm", "0.34.0", "vllm_v0_34"),
        ("vllm", "0.33.0", "vllm_v0_33"),
        ("vllm", "0.33.2+cu130", "vllm_v0_33"),
        ("vllm", "0.30.1", "vllm_v0_30"),
        ("vllm", "0.32.0+cpu", "vllm_v0_32"),
        ("sglang", "0.5.23", "sglang_v0_5_23"),
        ("sglang", "0.5.23.post1", "sglang_v0_5_23"),
        ("sglang", "0.5.20", "sglang_v0_5_20"),
    ],
)
def test_supported_versions_find_their_patch_module(engine: str, version: str, module: str) -> None:
    assert find_line(engine, version).patch_module == module


@pytest.mark.parametrize(
    ("engine", "version", "listed"),
    [
        ("vllm", "0.31.0", "0.34.x, 0.33.x, 0.32.x, 0.30.x"),
        ("vllm", "0.35.0", "0.34.x, 0.33.x, 0.32.x, 0.30.x"),
        ("sglang", "0.5.21", "0.5.23, 0.5.20"),
        ("sglang", "nightly", "0.5.23, 0.5.20"),
    ],
)
def test_other_versions_are_refused_with_the_supported_list(
    engine: str, version: str, listed: str
) -> None:
    with pytest.raises(UnsupportedEngineVersionError) as info:
        find_line(engine, version)
    assert f"{engine} {version} is not supported by kvshare" in str(info.value)
    assert f"supported {engine} versions: {listed}" in str(info.value)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(UnsupportedEngineVersionError, match="no hooks for the engine 'tgi'"):
        find_line("tgi", "1.0")


def test_every_line_tests_a_release_of_its_own_range() -> None:
    for line in SUPPORTED:
        assert find_line(line.engine, line.tested) == line


def test_the_test_environments_pin_the_tested_releases() -> None:
    for line in SUPPORTED:
        engine_layer = engine_env.layers(line)[0]
        assert engine_layer.requirements == (f"{line.engine}=={line.tested}",)
