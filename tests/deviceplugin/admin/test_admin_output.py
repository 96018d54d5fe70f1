"""``kvshare ctl`` and ``kvshare top`` print what the agent reports without letting any
value add a row, move the cursor or crash the table; ``--json`` stays exact."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.deviceplugin.admin.ctl_cli import render_gpus, render_pools
from kvshare.deviceplugin.broker.views import BooksView, GpuView, PoolView
from tests.deviceplugin.conftest import GIB, kvshare_cli

HOSTILE = [
    "llm\n9  forged/row  0  100  0  -  8.0Gi",
    "\x1b[2J\x1b[H\x1b[31mred",
    "\ud800",
    "\u202eevil",
    "tab\there\rcarriage",
    "zero\u200bwidth",
]


def _gpu(uuid: str, name: str) -> GpuView:
    return GpuView(uuid=uuid, index=0, name=name, total=8 * GIB, headroom=0, healthy=True,
                   draining=False, static=0, kv_min=0, kv_lease=0, kv_charged=0, kv_mapped=0,
                   kv_used=0, free=8 * GIB, unleased=0, overcommitted=0, min_shortfall=0,
                   pools_sized_larger=0, pools=1, turn_holder=HOSTILE[1],
                   turn_waiting=0)  # fmt: skip


def _pool(pool_id: int, text: str) -> PoolView:
    return PoolView(id=pool_id, name=text, gpu=text, pid=1, namespace=text, pod=text,
                    pod_uid=text, modelserver=text, rank=0, tp_size=1, engine=text, priority=1,
                    page_size=4096, static=0, kv_min=0, kv_max=None, lease=0, charged=0, want=0,
                    mapped=0, used=0, cached=0, reserved=0, device_bytes=None,
                    over_lease=False, reclaim_target=None, reclaim_overdue=False,
                    orphaned=False, age_s=0.0)  # fmt: skip


def hostile_view() -> BooksView:
    return BooksView(
        gpus=[_gpu(text, text) for text in HOSTILE],
        pools=[_pool(i, text) for i, text in enumerate(HOSTILE)],
        recovering=False,
    )


def test_tables_escape_every_value_and_keep_one_line_per_row() -> None:
    view = hostile_view()
    tables = ((render_pools(view), len(view.pools)), (render_gpus(view), len(view.gpus)))
    for rendered, rows in tables:
        rendered.encode("utf-8")  # no lone surrogate left: printable on any terminal
        lines = rendered.splitlines()
        assert len(lines) == 1 + rows, rendered
        assert all(line.isprintable() for line in lines), rendered
    assert "\\x1b[2J" in render_pools(view) and "\\u202eevil" in render_pools(view)


@pytest.fixture
def stand_in_agent(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """An admin socket answering every request with the next raw reply of a list: an
    agent gone wrong, which the real one (its inputs checked at decode) cannot become."""
    path = Path("/tmp") / f"kvs-admin-{tmp_path.name[-8:]}.sock"
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    replies: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                payload = replies.pop(0)
                conn.sendall(struct.pack(">I", len(payload)) + payload)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, replies
    server.close()
    path.unlink(missing_ok=True)


def test_ctl_and_top_refuse_a_reply_with_unprintable_values_in_words(
    stand_in_agent: tuple[Path, list[bytes]],
) -> None:
    path, replies = stand_in_agent
    reply = {"type": "admin-reply", "ok": True, "error": "",
             "view": dataclasses.asdict(hostile_view())}  # fmt: skip
    replies += [json.dumps(reply).encode()] * 2
    for command in (("ctl", "--admin-socket", str(path), "pools"),
                    ("top", "--admin-socket", str(path), "--iterations", "1")):  # fmt: skip
        done = kvshare_cli(*command)
        assert done.returncode == 1 and done.stdout == "", done
        assert "unexpected reply from the node agent" in done.stderr
        assert "is not printable text" in done.stderr and "\x1b" not in done.stderr


def test_ctl_and_top_print_their_errors_escaped() -> None:
    path = "/tmp/no-agent-\x1b[2J\x1b[H-here.sock"
    for command in (("ctl", "--admin-socket", path, "pools"),
                    ("top", "--admin-socket", path, "--iterations", "1")):  # fmt: skip
        done = kvshare_cli(*command)
        assert done.returncode == 1 and "no admin socket at" in done.stderr, done.stderr
        assert "\x1b" not in done.stderr and "\\x1b[2J" in done.stderr
