"""``kvshare crds``: print both CustomResourceDefinitions (pipe into ``kubectl apply -f -``)."""

from __future__ import annotations

import argparse
import sys

from kvshare.api.crds import crds_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the output is the CRDs of this kvshare version."""
    del parser


def run(args: argparse.Namespace) -> int:
    """Write the CRDs to stdout."""
    del args
    sys.stdout.write(crds_yaml())
    return 0
