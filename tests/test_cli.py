"""The `kvshare` command: every subcommand has --help, and the foundation commands work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from kvshare import __version__
from kvshare.cli import SUBCOMMANDS, main


def kvshare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name: str) -> None:
    done = kvshare(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: kvshare {name}")


def test_top_level_help_lists_every_subcommand() -> None:
    done = kvshare("--help")
    assert done.returncode == 0
    for name in SUBCOMMANDS:
        assert name in done.stdout


def test_version_prints_package_and_api_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out == f"kvshare {__version__} (kvshare.io/v1alpha1)\n"


def test_crds_prints_both_definitions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["metadata"]["name"] for d in docs] == [
        "modelservers.kvshare.io",
        "kvsharenodes.kvshare.io",
    ]


def test_unknown_subcommand_is_an_error() -> None:
    done = kvshare("frobnicate")
    assert done.returncode == 2
    assert "invalid choice: 'frobnicate'" in done.stderr


def test_bad_log_level_is_reported_not_raised() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "version"],
        capture_output=True,
        text=True,
        check=False,
        env={"KVSHARE_LOG_LEVEL": "LOUD", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "KVSHARE_LOG_LEVEL='LOUD'" in done.stderr
