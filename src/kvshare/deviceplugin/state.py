"""The broker's restart file: which pools were admitted, so a restarted broker knows whom
to wait for before it lends memory again.

Only what changes at admission and departure is written (never leases: those change on
every grant and come back from the pools themselves when they re-declare). The file is
replaced atomically, so a crash mid-write leaves the previous version.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from kvshare.deviceplugin.books import ExpectedPool
from kvshare.deviceplugin.peers import process_start_time

__all__ = ["load_expected", "save_pools"]

log = logging.getLogger(__name__)

_VERSION = 1


def save_pools(path: Path, pools: Iterable[tuple[ExpectedPool, int | None]]) -> None:
    """Write the admitted pools (each with its process start time) to ``path``."""
    entries = [{**asdict(pool), "start_time": start} for pool, start in pools]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": _VERSION, "pools": entries}), encoding="utf-8")
    os.replace(tmp, path)


def load_expected(path: Path) -> list[ExpectedPool]:
    """Pools of the previous broker whose processes are still running.

    A missing file means a first start; an unreadable one is logged and ignored (the
    pools still re-declare, the broker just cannot hold back new grants for them).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != _VERSION:
            raise ValueError(f"version {data.get('version')!r}")
        entries = data["pools"]
        pools = [
            (
                ExpectedPool(
                    pid=int(e["pid"]),
                    name=str(e["name"]),
                    gpu=str(e["gpu"]),
                    static=int(e["static"]),
                    kv_min=int(e["kv_min"]),
                ),
                e.get("start_time"),
            )
            for e in entries
        ]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring unreadable broker state %s: %s", path, exc)
        return []
    alive = []
    for pool, start_time in pools:
        now_start = process_start_time(pool.pid)
        if now_start is not None and (start_time is None or now_start == start_time):
            alive.append(pool)
    return alive
