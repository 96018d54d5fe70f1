"""``kvshare ctl``: look at and steer the node agent's broker through its admin socket."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvshare.api import names
from kvshare.api.quantity import QuantityError, format_bytes_human, parse_bytes
from kvshare.deviceplugin.admin.client import AdminClient, AdminError
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.deviceplugin.broker.views import BooksView, PoolView


def default_admin_socket() -> str:
    """``admin.sock`` in the node agent's own directory (``kvshare node --admin-dir``)."""
    return str(Path(names.ADMIN_DIR) / names.ADMIN_SOCKET_NAME)


def add_admin_socket(parser: argparse.ArgumentParser) -> None:
    """The ``--admin-socket`` option shared by ctl and top."""
    parser.add_argument(
        "--admin-socket", metavar="PATH", default=None,
        help="the node agent's admin socket (default: "
        f"{names.ADMIN_DIR}/{names.ADMIN_SOCKET_NAME}, inside the agent's container)",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``pools``, ``gpus``, ``set-max``, ``drain``, ``undrain``."""
    add_admin_socket(parser)
    parser.add_argument("--json", action="store_true", help="print the books as JSON")
    commands = parser.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    commands.add_parser("pools", help="list pools: lease, min, max, mapped, flags")
    commands.add_parser("gpus", help="list GPUs: budget, leases, free")
    set_max = commands.add_parser("set-max", help="change a pool's KV cap (reclaims above it)")
    set_max.add_argument("pool", help="pool id or name (see `kvshare ctl pools`)")
    set_max.add_argument("size", help="new cap, e.g. 8Gi, or 'none' for no cap")
    drain = commands.add_parser("drain", help="reclaim every pool on a GPU to its min, admit none")
    drain.add_argument("gpu", help="GPU UUID or index")
    undrain = commands.add_parser("undrain", help="let a drained GPU lend and admit again")
    undrain.add_argument("gpu", help="GPU UUID or index")


def terminal_safe(text: str) -> str:
    """``text`` as it may reach a terminal: printable characters as they are, any other
    (line breaks, escape sequences, bidi and zero-width marks, lone surrogates) as its
    Python escape, so that no value can add a row, move the cursor or fail to print."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes_human(value)


def _flags(pool: PoolView) -> str:
    flags = []
    if pool.over_lease:
        flags.append("OVER-LEASE")
    if pool.reclaim_target is not None:
        flags.append(f"reclaiming->{_bytes(pool.reclaim_target)}")
    if pool.reclaim_overdue:
        flags.append("OVERDUE")
    if pool.orphaned:
        flags.append("disconnected")
    return ",".join(flags) or "-"


def _table(header: list[str], rows: list[list[str]]) -> str:
    rows = [[terminal_safe(cell) for cell in row] for row in rows]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def render_pools(view: BooksView) -> str:
    """The pools as a table."""
    index = {g.uuid: str(g.index) for g in view.gpus}
    header = [
        "ID",
        "POOL",
        "GPU",
        "PRIO",
        "MIN",
        "MAX",
        "LEASE",
        "MAPPED",
        "USED",
        "DEVICE",
        "FLAGS",
    ]
    rows = [
        [
            str(p.id), p.name, index.get(p.gpu, p.gpu[:12]), str(p.priority), _bytes(p.kv_min),
            _bytes(p.kv_max), _bytes(p.lease), _bytes(p.mapped), _bytes(p.used),
            _bytes(p.device_bytes), _flags(p),
        ]
        for p in view.pools
    ]  # fmt: skip
    return _table(header, rows)


def render_gpus(view: BooksView) -> str:
    """The GPUs as a table."""
    header = ["GPU", "UUID", "TOTAL", "STATIC", "KV-MIN", "LEASED", "MAPPED", "UNLEASED", "FREE",
              "POOLS", "STATE"]  # fmt: skip
    rows = []
    for g in view.gpus:
        state = "draining" if g.draining else ("healthy" if g.healthy else "UNHEALTHY")
        if g.min_shortfall:
            state += f",MINIMUMS-DO-NOT-FIT(by {_bytes(g.min_shortfall)})"
        elif g.overcommitted:
            state += f",over-committed(reclaiming {_bytes(g.overcommitted)})"
        if g.pools_sized_larger:
            state += f",SMALLER-THAN-KV-CACHES({g.pools_sized_larger} pools)"
        if g.turn_holder:
            state += f",starting({g.turn_holder}, {g.turn_waiting} waiting)"
        rows.append(
            [
                str(g.index), g.uuid, _bytes(g.total), _bytes(g.static), _bytes(g.kv_min),
                _bytes(g.kv_lease), _bytes(g.kv_mapped), _bytes(g.unleased), _bytes(g.free),
                str(g.pools), state,
            ]
        )  # fmt: skip
    return _table(header, rows)


def run(args: argparse.Namespace) -> int:
    """Run one admin action and print the result."""
    client = AdminClient(args.admin_socket or default_admin_socket())
    command = args.ctl_command
    try:
        if command == "set-max":
            size = None
            if args.size.lower() != "none":
                try:
                    size = parse_bytes(args.size, field="size")
                except QuantityError as exc:
                    sys.stderr.write(f"kvshare ctl: {exc}\n")
                    return 2
            request = AdminRequest(op="set-max", pool=args.pool, size=size)
        elif command in ("drain", "undrain"):
            request = AdminRequest(op=command, gpu=args.gpu)
        else:
            request = AdminRequest(op="list")
        view = client.request(request)
    except AdminError as exc:
        sys.stderr.write(f"kvshare ctl: {terminal_safe(str(exc))}\n")
        return 1
    if args.json:
        # JSON escapes what a terminal must not see, and keeps every value exact.
        sys.stdout.write(json.dumps(dataclasses.asdict(view), indent=2) + "\n")
    elif command in ("gpus", "drain", "undrain"):
        sys.stdout.write(render_gpus(view))
    else:
        sys.stdout.write(render_pools(view))
    return 0
