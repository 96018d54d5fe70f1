"""A hostile neighbour on the broker socket: well-formed frames with hostile values, sent
over real sockets to a live ``kvshare node``. Each is refused at decode, closes only its
own connection, and leaves the books, ``/metrics``, the log and ``kvshare ctl`` intact."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kvshare.api.wire import BROKER_CODEC, Hello, Message, Refused, Welcome
from tests.deviceplugin.conftest import MIB, AgentProcess, PoolProcess, kvshare_cli, wait_until

AgentFactory = Callable[..., AgentProcess]
PoolFactory = Callable[..., PoolProcess]


def frame(body: dict[str, Any] | bytes) -> bytes:
    """One frame; a dict is sent as JSON exactly as given (lone surrogates escaped)."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return struct.pack(">I", len(payload)) + payload


def hello(agent: AgentProcess, **fields: Any) -> dict[str, Any]:
    """A valid hello's JSON body with ``fields`` replaced."""
    valid = Hello(version=1, gpu=agent.gpus[0].uuid, page_size=2 * MIB, kv_min=0, kv_max=None,
                  priority=100, static=0, namespace="test", pod="neighbour")  # fmt: skip
    return {"type": "hello", **dataclasses.asdict(valid), **fields}


def converse(
    agent: AgentProcess, *frames: bytes, wait_s: float = 5.0
) -> tuple[list[Message], bool]:
    """Send ``frames`` on a new connection: the replies, and whether the broker closed it
    within ``wait_s`` (a welcomed pool's connection stays open)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait_s)
        sock.connect(str(agent.broker_socket))
        for data in frames:
            sock.sendall(data)
        received, closed = b"", False
        try:
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
        except TimeoutError:
            pass
    replies, offset = [], 0
    while offset + 4 <= len(received):
        (length,) = struct.unpack_from(">I", received, offset)
        replies.append(BROKER_CODEC.decode(received[offset + 4 : offset + 4 + length]))
        offset += 4 + length
    return replies, closed


def scrape(agent: AgentProcess) -> str:
    """``/metrics``; fails the test unless it answers 200."""
    try:
        return agent.metrics()
    except Exception as exc:
        pytest.fail(f"/metrics did not answer 200: {type(exc).__name__}: {exc}")


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def protocol_errors(agent: AgentProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in series(scrape(agent))
        if line.startswith("kvshare_broker_protocol_errors_total")
    )


HOSTILE_IDENTITIES = [
    ("gpu", "GPU-\ud800"),
    ("namespace", "\ud800"),
    ("pod", "qwen-\udfff-0"),
    ("modelserver", "qwen\ud800"),
    ("namespace", "llm\nID  POOL  forged-row"),
    ("pod", "qwen-0\x1b[2J\x1b[H"),
    ("modelserver", "\uff51wen"),  # a fullwidth look-alike of "qwen"
    ("namespace", "LLM_Team"),
    ("pod", "p" * 254),
    ("pod_uid", "kubepods"),  # a substring of every pod's cgroup path
    ("engine", "vllm\u202e"),
    ("gpu", ""),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE_IDENTITIES, ids=lambda v: ascii(v)[:24])
def test_a_hello_with_a_hostile_identity_is_refused_at_decode(
    agent_factory: AgentFactory, field: str, value: str
) -> None:
    agent = agent_factory("1x2Gi")
    before = protocol_errors(agent)
    replies, closed = converse(agent, frame(hello(agent, **{field: value})))
    assert closed and len(replies) == 1 and isinstance(replies[0], Refused), replies
    assert replies[0].reason.startswith(f"protocol error: Hello.{field}: "), replies[0].reason
    assert agent.view().pools == []
    text = scrape(agent)
    assert protocol_errors(agent) == before + 1
    assert 'kvshare_broker_protocol_errors_total{kind="identity"}' in text
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/readyz") as ready:
        assert ready.status == 200


@pytest.mark.parametrize(
    "body",
    [
        {"kv_max": 10**400},
        {"static": 2**64},
        {"kv_min": -(2**70)},
        {"held": 1e400},
        {"rank": float("nan")},
    ],
    ids=lambda b: ascii(b)[:20],
)
def test_a_hello_with_numbers_outside_64_bits_is_refused(
    agent_factory: AgentFactory, body: dict[str, Any]
) -> None:
    agent = agent_factory("1x2Gi")
    replies, closed = converse(agent, frame(hello(agent, **body)))
    assert closed and isinstance(replies[-1], Refused), replies
    assert replies[-1].reason.startswith("protocol error: Hello."), replies[-1].reason
    assert agent.view().pools == []
    scrape(agent)


def test_a_pool_reporting_sizes_outside_64_bits_is_disconnected_and_metrics_serve(
    agent_factory: AgentFactory,
) -> None:
    agent = agent_factory("1x2Gi")
    report = {"type": "report", "mapped": 0, "used": 10**30, "cached": 0, "reserved": 0}
    replies, closed = converse(agent, frame(hello(agent)), frame(report))
    assert isinstance(replies[0], Welcome) and closed
    assert isinstance(replies[-1], Refused) and "Report.used" in replies[-1].reason
    scrape(agent)


def test_deeply_nested_frames_are_protocol_errors_that_close_the_connection(
    agent_factory: AgentFactory,
) -> None:
    agent = agent_factory("1x2Gi")
    before = protocol_errors(agent)
    nested_list = b"[" * 8000 + b"]" * 8000  # within the frame limit
    nested_field = json.dumps(hello(agent, gpu="@")).replace('"@"', "[" * 900 + "]" * 900)
    for body in (nested_list, nested_field.encode()):
        replies, closed = converse(agent, frame(body))
        assert closed, "the broker kept the connection open"
        assert isinstance(replies[-1], Refused) and "nested" in replies[-1].reason
    assert protocol_errors(agent) == before + 2
    assert not any("Traceback" in line or "RecursionError" in line for line in agent.log)


def test_refused_and_departed_pools_leave_no_series_behind(agent_factory: AgentFactory) -> None:
    agent = agent_factory("1x2Gi")

    def come_and_go(index: int) -> None:
        replies, _ = converse(agent, frame(hello(agent, pod=f"p-{index}")), frame({"type": "bye"}))
        assert isinstance(replies[0], Welcome)

    come_and_go(0)  # the GPU's own counters exist from the first grant on
    wait_until(lambda: not agent.view().pools, what="the first pool to leave")
    baseline = scrape(agent)
    for index in range(300):
        replies, _ = converse(agent, frame(hello(agent, gpu=f"GPU-unknown-{index}")))
        assert isinstance(replies[0], Refused) and "unknown GPU" in replies[0].reason
    for index in range(1, 101):
        come_and_go(index)
    wait_until(lambda: not agent.view().pools, what="the pools to leave")
    after = scrape(agent)
    # One series for "refused: unknown GPU" (its count and creation time) may be new;
    # nothing per refused GPU name or per departed pool.
    assert len(series(after)) <= len(series(baseline)) + 2, sorted(
        set(series(after)) - set(series(baseline))
    )[:10]
    assert len(after) <= len(baseline) + 512
    assert "GPU-unknown" not in after and 'pod="p-' not in after


def test_protocol_errors_are_logged_at_a_bounded_rate_with_what_was_suppressed(
    agent_factory: AgentFactory,
) -> None:
    agent = agent_factory("1x2Gi")
    began = time.monotonic()
    for _ in range(1000):
        converse(agent, frame(b'{"type": "grant-me-everything"}'))
    elapsed = time.monotonic() - began
    assert protocol_errors(agent) == 1000

    def logged() -> list[str]:
        return [line for line in agent.log if "closing connection" in line]

    def suppressed() -> int:
        return sum(
            int(line.split(" more protocol error")[0].rsplit(" ", 1)[1])
            for line in agent.log
            if "not logged" in line
        )

    # Every error is either logged or counted in a "not logged" line (once its window ends).
    wait_until(lambda: len(logged()) + suppressed() == 1000, 30, "the suppressed counts")
    assert suppressed() > 0
    # At most 10 lines per 5 s window, however fast the errors come.
    assert len(logged()) <= 10 * (int(elapsed / 5) + 2), len(logged())


def test_kvshare_ctl_shows_exactly_the_real_pools_whatever_neighbours_send(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory("1x2Gi")
    real = pool_factory(agent, "real")
    assert real.error is None
    hostile = [
        {"namespace": "\ud800"},
        {"namespace": "llm", "pod": "a\n9  forged/row  0  100  0  -  8.0Gi"},
        {"pod": "b\x1b[2J\x1b[31mred"},
        {"modelserver": "\u202eevil"},
    ]
    held = []
    for fields in hostile:  # each kept open: a welcomed pool would stay in the books
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(agent.broker_socket))
        sock.sendall(frame(hello(agent, **fields)))
        held.append(sock)
        assert sock.recv(65536), "no answer to the hello"
    try:
        admin = ("--admin-socket", str(agent.admin_socket))
        table = kvshare_cli("ctl", *admin, "pools")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert len(lines) == 2 and lines[1].split()[1] == "test/real", table.stdout
        assert "\x1b" not in table.stdout
        listed = json.loads(kvshare_cli("ctl", *admin, "--json", "pools").stdout)
        assert [p["name"] for p in listed["pools"]] == ["test/real"]
    finally:
        for sock in held:
            sock.close()


HOLD_POOLS = """
import json, socket, struct, sys
path, body, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
held, answers = [], []
for i in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    payload = json.dumps({**body, "pod": f"{body['pod']}-{i}"}).encode()
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    answers.append(json.loads(sock.recv(65536)[4:])["type"])
    held.append(sock)
print(json.dumps(answers), flush=True)
sys.stdin.read()
"""


def test_one_process_holds_at_most_64_pools_and_hundreds_still_list(
    agent_factory: AgentFactory,
) -> None:
    agent = agent_factory("1x2Gi")
    hold = [sys.executable, "-c", HOLD_POOLS, str(agent.broker_socket)]
    holders = [
        subprocess.Popen(
            [*hold, json.dumps(hello(agent, pod=f"h{n}")), str(70 if n == 0 else 60)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(12)
    ]
    try:
        answers = [json.loads(h.stdout.readline()) for h in holders if h.stdout]
        assert answers[0] == ["welcome"] * 64 + ["refused"] * 6
        assert all(a == ["welcome"] * 60 for a in answers[1:])
        listed = kvshare_cli("ctl", "--admin-socket", str(agent.admin_socket), "--json", "pools")
        assert listed.returncode == 0, listed.stderr
        assert len(json.loads(listed.stdout)["pools"]) == 64 + 11 * 60  # > 256 KiB
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(30)
