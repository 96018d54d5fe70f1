"""``kvshare top``: a live view of the node's GPUs and pools, refreshed in place."""

from __future__ import annotations

import argparse
import sys
import time

from kvshare.deviceplugin.admin.client import AdminClient, AdminError
from kvshare.deviceplugin.admin.ctl_cli import (
    add_admin_socket,
    default_admin_socket,
    render_gpus,
    render_pools,
    terminal_safe,
)
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest

_HOME_AND_CLEAR = "\x1b[H\x1b[2J"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Refresh interval and how many refreshes."""
    add_admin_socket(parser)
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)"
    )
    parser.add_argument(
        "--iterations", type=int, default=0, metavar="N",
        help="stop after N refreshes (default: until interrupted)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Redraw the tables until interrupted (in place on a terminal)."""
    client = AdminClient(args.admin_socket or default_admin_socket())
    in_place = sys.stdout.isatty()
    shown = 0
    try:
        while args.iterations <= 0 or shown < args.iterations:
            try:
                view = client.request(AdminRequest(op="list"))
            except AdminError as exc:
                sys.stderr.write(f"kvshare top: {terminal_safe(str(exc))}\n")
                return 1
            stamp = time.strftime("%H:%M:%S")
            recovering = "  (recovering after a restart)" if view.recovering else ""
            frame = (
                f"kvshare top  {stamp}  {len(view.gpus)} GPU(s), {len(view.pools)} pool(s)"
                f"{recovering}\n\n{render_gpus(view)}\n{render_pools(view)}"
            )
            sys.stdout.write((_HOME_AND_CLEAR if in_place else "\n") + frame)
            sys.stdout.flush()
            shown += 1
            if args.iterations <= 0 or shown < args.iterations:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0
