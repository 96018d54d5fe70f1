"""Environment variables: one reader and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvshare.api import env

ROOT = Path(__file__).resolve().parents[2]


def test_values_parse_with_defaults() -> None:
    assert env.PAGE_SIZE.read({}) == 2 * 2**20
    assert env.PAGE_SIZE.read({"KVSHARE_PAGE_SIZE": "4Mi"}) == 4 * 2**20
    assert env.ENABLE.read({"KVSHARE_ENABLE": "true"}) is True
    assert env.ENABLE.read({}) is False
    assert env.KV_MAX.read({}) is None
    assert env.KV_MAX.read({"KVSHARE_KV_MAX": ""}) is None


@pytest.mark.parametrize(
    ("var", "raw", "fragment"),
    [
        (env.PAGE_SIZE, "2MB", "'2MB' is not a valid quantity"),
        (env.ENABLE, "maybe", "expected 1/0, true/false"),
        (env.LAYOUT, "paged", "expected one of auto, block-outer, per-layer"),
        (env.RESERVE_PAGES, "-1", "must be >= 0"),
        (env.STARTUP_TIMEOUT, "0", "must be a number of seconds > 0"),
    ],
)
def test_bad_values_name_the_variable_and_its_meaning(
    var: env.EnvVar[object], raw: str, fragment: str
) -> None:
    with pytest.raises(env.EnvError) as info:
        var.read({var.name: raw})
    message = str(info.value)
    assert message.startswith(f"{var.name}={raw!r}: ")
    assert fragment in message
    assert var.meaning in message


def test_require_explains_a_missing_variable() -> None:
    with pytest.raises(env.EnvError, match="KVSHARE_POD_NAME is not set"):
        env.POD_NAME.require({})


def test_every_variable_is_listed_once_and_prefixed() -> None:
    names = [var.name for var in env.ALL]
    assert len(names) == len(set(names))
    assert all(name.startswith("KVSHARE_") for name in names)
    declared = {value.name for value in vars(env).values() if isinstance(value, env.EnvVar)}
    assert declared == set(names), "an EnvVar is declared but missing from env.ALL"


def test_only_the_env_module_reads_the_environment() -> None:
    pattern = re.compile(r"os\.environ(?!\s*\)|\.copy\(\))|os\.getenv|environ\.get\(")
    offenders = []
    for path in (ROOT / "src" / "kvshare").rglob("*.py"):
        if path == ROOT / "src" / "kvshare" / "api" / "env.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "read environment variables through kvshare.api.env"
