"""What a hostile tenant runs inside its pod (``python -m tests.deviceplugin.trust.tenant``):
raw conversations with the node agent's sockets, one JSON line of results on stdout.

- ``frames SOCKET BODIES``: one connection; sends each body (a JSON list of message
  bodies) as a frame, then reads until the agent closes it or ``--wait`` seconds pass:
  ``{"replies": [...], "closed": bool}``; with ``--hold`` it then keeps the connection
  open until stdin closes;
- ``connect SOCKET N``: opens N connections and says nothing on them; after ``--wait``
  seconds: ``{"open": n, "refused": {label: n}, "reasons": [...first few...]}`` (a
  refusal's label is its reason up to the first ``:``); holds them until stdin closes;
- ``pools SOCKET HELLO N``: forks N processes, each saying HELLO (its pod name suffixed)
  and holding its pool: ``{"welcome": n, "refused": n, "reasons": [...]}``; holds until
  stdin closes;
- ``admin SOCKET``: asks the admin socket for the books: ``{"error": "..."}`` or
  ``{"pools": n}``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time
from typing import Any


def frame(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return struct.pack(">I", len(payload)) + payload


def read_replies(
    sock: socket.socket, wait_s: float, enough: int = 0
) -> tuple[list[dict[str, Any]], bool]:
    """The frames the agent sends within ``wait_s`` (or until ``enough`` came) and whether
    it closed the connection."""
    sock.settimeout(wait_s)
    received, closed = b"", False
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            received += chunk
            if enough and _count(received) >= enough:
                break
    except TimeoutError:
        pass
    except ConnectionResetError:  # closed with what this side sent still unread
        closed = True
    replies, offset = [], 0
    while offset + 4 <= len(received):
        (length,) = struct.unpack_from(">I", received, offset)
        replies.append(json.loads(received[offset + 4 : offset + 4 + length]))
        offset += 4 + length
    return replies, closed


def _count(received: bytes) -> int:
    count, offset = 0, 0
    while offset + 4 <= len(received):
        (length,) = struct.unpack_from(">I", received, offset)
        if offset + 4 + length > len(received):
            break
        count, offset = count + 1, offset + 4 + length
    return count


def _frames(args: argparse.Namespace) -> dict[str, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    for body in json.loads(args.bodies):
        try:
            sock.sendall(frame(body))
        except OSError:  # refused before it was read: the refusal waits to be read
            break
    replies, closed = read_replies(sock, args.wait, args.replies)
    result = {"replies": replies, "closed": closed}
    if not args.hold:
        return result
    print(json.dumps(result), flush=True)
    sys.stdin.read()
    return {}


def _connect(args: argparse.Namespace) -> dict[str, Any]:
    held = []
    for _ in range(args.count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(args.socket)
        except OSError:
            sock.close()
            continue
        held.append(sock)
    time.sleep(args.wait)
    refused: dict[str, int] = {}
    reasons: list[str] = []
    poller = select.poll()
    for sock in held:
        poller.register(sock, select.POLLIN | select.POLLHUP)
    ready = {fd for fd, _ in poller.poll(0)}
    for sock in held:
        if sock.fileno() in ready:
            replies, closed = read_replies(sock, 0.01)
            if closed or replies:
                reason = str(replies[0].get("reason", "")) if replies else "closed"
                label = reason.split(":", 1)[0]
                refused[label] = refused.get(label, 0) + 1
                if len(reasons) < 3:
                    reasons.append(reason)
    gone = sum(refused.values())
    print(json.dumps({"open": len(held) - gone, "refused": refused, "reasons": reasons}),
          flush=True)  # fmt: skip
    sys.stdin.read()
    return {}


def _pools(args: argparse.Namespace) -> dict[str, Any]:
    hello = json.loads(args.hello)
    readers = []
    for index in range(args.count):
        read_end, write_end = os.pipe()
        if os.fork() == 0:
            os.close(read_end)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(args.socket)
            sock.sendall(frame({**hello, "rank": index % 8}))
            replies, _ = read_replies(sock, 5.0)
            answer = replies[0] if replies else {"type": "closed"}
            os.write(write_end, json.dumps(answer).encode() + b"\n")
            os.close(write_end)
            sys.stdin.read()  # hold the pool until the test ends
            os._exit(0)
        os.close(write_end)
        readers.append(read_end)
    welcome, refused, reasons = 0, 0, []
    for fd in readers:
        with os.fdopen(fd) as pipe:
            answer = json.loads(pipe.readline() or '{"type": "closed"}')
        if answer.get("type") == "welcome":
            welcome += 1
        else:
            refused += 1
            if len(reasons) < 3:
                reasons.append(answer.get("reason", answer.get("type")))
    print(json.dumps({"welcome": welcome, "refused": refused, "reasons": reasons}), flush=True)
    sys.stdin.read()
    return {}


def _admin(args: argparse.Namespace) -> dict[str, Any]:
    from kvshare.deviceplugin.admin.client import AdminClient, AdminError
    from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest

    try:
        view = AdminClient(args.socket).request(AdminRequest(op="list"))
    except AdminError as exc:
        return {"error": str(exc)}
    return {"pools": len(view.pools)}


def main() -> int:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    frames = commands.add_parser("frames")
    frames.add_argument("socket")
    frames.add_argument("bodies")
    frames.add_argument("--wait", type=float, default=5.0)
    frames.add_argument("--hold", action="store_true")
    frames.add_argument("--replies", type=int, default=0, help="stop reading after so many")
    connect = commands.add_parser("connect")
    connect.add_argument("socket")
    connect.add_argument("count", type=int)
    connect.add_argument("--wait", type=float, default=2.0)
    pools = commands.add_parser("pools")
    pools.add_argument("socket")
    pools.add_argument("hello")
    pools.add_argument("count", type=int)
    admin = commands.add_parser("admin")
    admin.add_argument("socket")
    args = parser.parse_args()
    handler = {"frames": _frames, "connect": _connect, "pools": _pools, "admin": _admin}
    result = handler[args.command](args)
    if result:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
