"""The ``kvshare`` command: one entry point for every program and tool.

Each subcommand lives with the program it runs, in a module that defines
``add_arguments(parser)`` and ``run(args) -> int`` and keeps its heavy imports inside
``run``, so ``kvshare --help`` and ``kvshare crds`` start without torch, grpc or kopf.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Protocol, cast

from kvshare import __version__
from kvshare.api import env

#: name -> (module implementing it, one-line help). Order is the order `--help` shows.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "node": ("kvshare.deviceplugin.node_cli", "run the node agent: broker, device plugin, metrics"),
    "ctl": ("kvshare.deviceplugin.admin.ctl_cli", "inspect and steer the node agent's broker"),
    "top": ("kvshare.deviceplugin.admin.top_cli", "live view of the node's GPUs and KV pools"),
    "crds": ("kvshare.api.crds_cli", "print the CustomResourceDefinitions as YAML"),
    "demo": ("kvshare.demo.cli", "static partitions vs elastic KV caches, live, on this machine"),
    "twin": ("kvshare.twin.cli", "a workload's capacity at its latency SLO on a GPU twin"),
    "operator": (
        "kvshare.operator.cli",
        "run the operator: place ModelServers onto shared GPUs and run their pods",
    ),
    "version": ("kvshare.version_cli", "print the kvshare version"),
}


class _Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(module: str) -> _Subcommand:
    return cast(_Subcommand, importlib.import_module(module))


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="Elastic GPU memory sharing for LLM model servers on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"kvshare {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _load(module).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        level = env.LOG_LEVEL.read() or "INFO"
    except env.EnvError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    return _load(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
