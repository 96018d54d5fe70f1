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

from kvshare.deviceplugin.broker.books import ExpectedPool, PoolRecord
from kvshare.deviceplugin.broker.peers import process_start_time

__all__ = ["AdmittedPools", "load_expected", "save_pools"]

log = logging.getLogger(__name__)

_VERSION = 1


def save_pools(path: Path, pools: Iterable[tuple[ExpectedPool, int | None]]) -> None:
    """Write the admitted pools (each with its process start time) to ``path``."""
    entries = [{**asdict(pool), "start_time": start} for pool, start in pools]
    tmp = path.with_name(path.name + ".tmp")
    # 0600: it names every tenant's pods and pids.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(json.dumps({"version": _VERSION, "pools": entries}))
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
                    gpu_total=int(e.get("gpu_total", 0)),
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


class AdmittedPools:
    """The pools admitted, as the restart file at ``path`` lists them (None: no file).

    Touched by the broker's loop thread only; every change is written by :meth:`save`.
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._pools: dict[int, tuple[ExpectedPool, int | None]] = {}

    def remember(self, record: PoolRecord, started: int | None) -> None:
        """What a restarted broker expects pool ``record`` (whose process started at
        ``started``) to re-declare."""
        self._pools[record.id] = (
            ExpectedPool(
                pid=record.pid,
                name=record.name,
                gpu=record.gpu,
                static=record.static,
                kv_min=record.kv_min,
                gpu_total=record.sized_for,
            ),
            started,
        )

    def refresh(self, record: PoolRecord) -> None:
        """Pool ``record`` changed (its minimum): remembered anew, if it is remembered."""
        if record.id in self._pools:
            self.remember(record, self._pools[record.id][1])

    def forget(self, pool_id: int) -> bool:
        """Pool ``pool_id`` left; whether it was remembered."""
        return self._pools.pop(pool_id, None) is not None

    def save(self) -> None:
        """Write the file (a failure is logged: the pools still re-declare after a
        restart, the broker just cannot hold back new grants for them)."""
        if self._path is None:
            return
        try:
            save_pools(self._path, self._pools.values())
        except OSError as exc:
            log.error("cannot write broker state %s: %s", self._path, exc)
