"""``kvshare version``: the installed kvshare version and the API version it serves."""

from __future__ import annotations

import argparse
import sys

from kvshare import __version__
from kvshare.api import names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""
    del parser


def run(args: argparse.Namespace) -> int:
    """Write ``kvshare <version> (<api version>)`` to stdout."""
    del args
    sys.stdout.write(f"kvshare {__version__} ({names.API_VERSION})\n")
    return 0
