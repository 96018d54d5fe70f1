"""Hostile neighbours of a live node agent: a seeded generator of bad conversations on
its sockets, and a campaign that runs them against ``kvshare node`` while a real pool
holds memory, watching that the agent stays up, ``/metrics`` answers, the books stay
consistent and the pool keeps its lease. Used by ``tests/deviceplugin/test_fuzz.py``
(short) and ``bench/fuzz.py`` (longer, with a report).

The attackers are processes of their own (``python -m tests.deviceplugin.hostile``), as
neighbour pods are: the pools they get admitted leave the books when they exit.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvshare.api.wire import BROKER_CODEC, MAX_REQUEST_BYTES, Hello, Message, Refused, Welcome
from kvshare.deviceplugin.admin.client import AdminError
from kvshare.deviceplugin.broker.views import BooksView
from tests.deviceplugin.conftest import MIB, ROOT, AgentProcess, PoolProcess

PAGE = 2 * MIB

#: Strings outside every identity's syntax: what a careless or hostile pod might send.
HOSTILE_STRINGS = [
    "\ud800", "a\udfffb", "llm\nID  POOL  forged", "x\x1b[2J\x1b[H", "\x00", "tab\t",
    "\uff51wen", "qwen\u202e", "zero\u200bwidth", "UPPER_Case.", "-leading", "trailing-",
    "a" * 254, "é", "space here", "{}", "../../etc", "%s%n", "GPU-0;rm -rf /",
]  # fmt: skip
#: Values no integer field takes: beyond 64 bits, not integers, or not numbers at all.
HOSTILE_NUMBERS: list[Any] = [
    2**63, -(2**63) - 1, 10**400, 1.5, float("nan"), float("inf"), True, "1", [1], {"a": 1},
]  # fmt: skip
IDENTITY_FIELDS = ("gpu", "namespace", "pod", "pod_uid", "modelserver", "engine")
NUMBER_FIELDS = ("version", "page_size", "kv_min", "priority", "static", "rank", "tp_size")


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def body(message: Message) -> dict[str, Any]:
    return dict(json.loads(BROKER_CODEC.encode(message)[4:]))


@dataclass(frozen=True)
class Conversation:
    """What one connection sends: ``chunks`` in order (``pause_s`` between them), on the
    broker or admin socket. ``hostile``: every reply must be a refusal or a close."""

    kind: str
    chunks: list[bytes]
    admin: bool = False
    hostile: bool = True
    pause_s: float = 0.0


class Generator:
    """Seeded conversations, one kind after another at random."""

    def __init__(self, gpu: str, seed: int) -> None:
        self.gpu = gpu
        self.rng = random.Random(seed)
        self.count = 0
        self.kinds: list[Callable[[], Conversation]] = [
            self.random_bytes, self.truncated, self.oversized, self.empty, self.not_json,
            self.nested, self.hostile_identity, self.hostile_number, self.unknown_field,
            self.repeated_key, self.wrong_first_message, self.slow_sender,
            self.hostile_turn_request, self.admitted_then_hostile, self.admin_garbage,
        ]  # fmt: skip

    def next(self) -> Conversation:
        self.count += 1
        return self.rng.choice(self.kinds)()

    def hello(self, **fields: Any) -> dict[str, Any]:
        valid = Hello(version=1, gpu=self.gpu, page_size=PAGE, kv_min=0, kv_max=None,
                      priority=self.rng.randint(0, 1000), static=0, namespace="fuzz",
                      pod=f"fuzz-{self.count}")  # fmt: skip
        return {**body(valid), **fields}

    def json_frame(self, value: Any) -> bytes:
        return frame(json.dumps(value).encode())

    def random_bytes(self) -> Conversation:
        return Conversation("random-bytes", [self.rng.randbytes(self.rng.randint(1, 4096))])

    def truncated(self) -> Conversation:
        whole = self.json_frame(self.hello())
        return Conversation("truncated-frame", [whole[: self.rng.randint(1, len(whole) - 1)]])

    def oversized(self) -> Conversation:
        length = self.rng.choice([MAX_REQUEST_BYTES + 1, 2**31, 2**32 - 1])
        return Conversation("oversized-frame", [struct.pack(">I", length) + b"x" * 256])

    def empty(self) -> Conversation:
        return Conversation("empty-frame", [struct.pack(">I", 0)])

    def not_json(self) -> Conversation:
        junk = self.rng.choice([b"\xff\xfe", b"{", b"[1,2]", b"null", b'"hello"', b"NaN"])
        return Conversation("not-json", [frame(junk)])

    def nested(self) -> Conversation:
        depth = self.rng.randint(9, 7000)
        if self.rng.random() < 0.5:
            return Conversation("nested", [frame(b"[" * depth + b"]" * depth)])
        text = json.dumps(self.hello(gpu="@")).replace('"@"', "[" * depth + "]" * depth)
        return Conversation("nested", [frame(text.encode()[:MAX_REQUEST_BYTES])])

    def hostile_identity(self) -> Conversation:
        name = self.rng.choice(IDENTITY_FIELDS)
        value = self.rng.choice(HOSTILE_STRINGS)
        return Conversation("hostile-identity", [self.json_frame(self.hello(**{name: value}))])

    def hostile_number(self) -> Conversation:
        name = self.rng.choice(NUMBER_FIELDS)
        value = self.rng.choice(HOSTILE_NUMBERS)
        return Conversation("hostile-number", [self.json_frame(self.hello(**{name: value}))])

    def unknown_field(self) -> Conversation:
        extra = {self.rng.choice(["pool_id", "lease_for", *HOSTILE_STRINGS]): 1}
        return Conversation("unknown-field", [self.json_frame(self.hello(**extra))])

    def repeated_key(self) -> Conversation:
        text = json.dumps(self.hello())[:-1] + ', "priority": 1000}'
        return Conversation("repeated-key", [frame(text.encode())])

    def wrong_first_message(self) -> Conversation:
        first = self.rng.choice([{"type": "want", "seq": 1, "total": 2**40}, {"type": "bye"},
                                 {"type": "turn-done", "seq": 1}, {"type": "welcome"}])  # fmt: skip
        return Conversation("wrong-first-message", [self.json_frame(first)])

    def slow_sender(self) -> Conversation:
        whole = self.json_frame(self.hello(namespace=self.rng.choice(HOSTILE_STRINGS)))
        pieces = [whole[i : i + 48] for i in range(0, len(whole), 48)]
        return Conversation("slow-sender", pieces, pause_s=0.002)

    def hostile_turn_request(self) -> Conversation:
        request = {"type": "turn-request", "seq": 1, "gpu": self.rng.choice(HOSTILE_STRINGS)}
        return Conversation("hostile-turn-request", [self.json_frame(request)])

    def admitted_then_hostile(self) -> Conversation:
        """A pool that is admitted, asks for memory, then breaks the protocol."""
        seq = self.rng.randint(1, 5)
        wants = [self.json_frame({"type": "want", "seq": s, "total": s * 64 * MIB})
                 for s in range(1, seq + 1)]  # fmt: skip
        last = self.rng.choice([
            {"type": "want", "seq": 0, "total": 1},
            {"type": "want", "seq": 9, "total": 10**30},
            {"type": "report", "mapped": -1, "used": 0, "cached": 0, "reserved": 0},
            {"type": "report", "mapped": 2**63, "used": 0, "cached": 0, "reserved": 0},
            self.hello(),
            {"type": "turn-request", "seq": 1, "gpu": self.gpu},
        ])  # fmt: skip
        chunks = [self.json_frame(self.hello()), *wants, self.json_frame(last)]
        return Conversation("admitted-then-hostile", chunks, hostile=False)

    def admin_garbage(self) -> Conversation:
        """Bad frames on the admin socket (valid changes would be the operator's, not
        a neighbour's: the admin socket is the agent's own user's only)."""
        choice = self.rng.choice([
            {"type": "admin-request", "op": self.rng.choice(HOSTILE_STRINGS)},
            {"type": "admin-request", "op": "list", "pool": 10**400},
            {"type": "admin-reply", "ok": True},
            {"type": "hello"},
        ])  # fmt: skip
        return Conversation("admin-garbage", [self.json_frame(choice)], admin=True)


def _replies(data: bytes) -> list[Message]:
    out, offset = [], 0
    while offset + 4 <= len(data):
        (length,) = struct.unpack_from(">I", data, offset)
        if offset + 4 + length > len(data):
            break
        out.append(BROKER_CODEC.decode(data[offset + 4 : offset + 4 + length]))
        offset += 4 + length
    return out


def converse(broker: str, admin: str, talk: Conversation) -> str:
    """Run one conversation on the broker (or ``admin``) socket; how it ended:
    ``refused``, ``closed`` (no refusal), ``welcomed`` or ``open`` (the agent neither
    answered nor closed within 10 s: generous, for a loaded machine; a hang is caught)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(admin if talk.admin else broker)
        try:
            for chunk in talk.chunks:
                sock.sendall(chunk)
                if talk.pause_s:
                    time.sleep(talk.pause_s)
            sock.shutdown(socket.SHUT_WR)  # a frame left incomplete is one that never ends
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            return "open"
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
    if talk.admin:
        return "refused" if data else "closed"
    replies = _replies(data)
    if replies and isinstance(replies[-1], Refused):
        return "refused"
    return "welcomed" if any(isinstance(r, Welcome) for r in replies) else "closed"


def consistency_problems(view: BooksView) -> list[str]:
    """What the admin view shows that the books must never allow."""
    problems = []
    for gpu in view.gpus:
        pools = [p for p in view.pools if p.gpu == gpu.uuid]
        charged = sum(p.charged for p in pools)
        if charged != gpu.kv_charged:
            problems.append(f"GPU {gpu.index}: pools charged {charged} != {gpu.kv_charged}")
        if gpu.kv_charged + gpu.static > gpu.total - gpu.headroom:
            problems.append(f"GPU {gpu.index}: over-committed")
        for pool in pools:
            if pool.lease % pool.page_size or pool.lease > pool.charged:
                problems.append(f"pool {pool.name}: lease {pool.lease} charged {pool.charged}")
    return problems


@dataclass
class Report:
    """What a campaign saw."""

    seconds: float = 0.0
    messages_sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    left_open: list[str] = field(default_factory=list)
    """Conversations the agent neither answered nor closed within 10 s (none, or a bug)."""
    hostile_admitted: list[str] = field(default_factory=list)
    """The first frame of each hostile conversation the broker welcomed (none, or a bug)."""
    crashes: int = 0
    scrapes: int = 0
    metrics_failures: int = 0
    books_problems: list[str] = field(default_factory=list)
    pool_kept_lease: bool = False
    pool_grew: bool = False
    new_series: list[str] = field(default_factory=list)
    """Series /metrics shows after the run (the attackers' pools gone) and did not before."""
    tracebacks: int = 0

    def fields(self) -> dict[str, float | int | str]:
        """The report as benchmark fields."""
        refused = self.outcomes["refused"] + self.outcomes["closed"]
        return {
            "seconds": round(self.seconds, 1),
            "messages_sent": self.messages_sent,
            "kinds_tried": len(self.kinds),
            "refused_or_closed": refused,
            "welcomed": self.outcomes["welcomed"],
            "left_open": len(self.left_open),
            "hostile_admitted": len(self.hostile_admitted),
            "crashes": self.crashes,
            "scrapes": self.scrapes,
            "metrics_failures": self.metrics_failures,
            "books_inconsistencies": len(self.books_problems),
            "pool_kept_lease": int(self.pool_kept_lease),
            "pool_grew": int(self.pool_grew),
            "series_growth": len(self.new_series),
            "agent_tracebacks": self.tracebacks,
        }


def _series(agent: AgentProcess) -> set[str]:
    """The names and labels of every sample /metrics shows."""
    return {line.rsplit(" ", 1)[0] for line in agent.metrics().splitlines() if line[:1] not in "#"}


def _watch(agent: AgentProcess, report: Report, stop: threading.Event) -> None:
    """Scrape /metrics and read the books every 0.2 s while the campaign runs."""
    url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
    while not stop.wait(0.2):
        report.scrapes += 1
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status != 200:
                    report.metrics_failures += 1
        except Exception:
            report.metrics_failures += 1
        try:
            report.books_problems += consistency_problems(agent.view())
        except AdminError as exc:
            report.books_problems.append(f"admin socket: {exc}")


def attack(broker: str, admin: str, gpu: str, seconds: float, seed: int) -> dict[str, Any]:
    """One attacker: conversations back to back for ``seconds`` (each kind once when
    ``seconds`` is 0); what it sent and saw."""
    generator = Generator(gpu, seed)
    once = iter(generator.kinds) if seconds <= 0 else None
    kinds: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    sent = 0
    admitted: list[str] = []
    left_open: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or once is not None:
        make = next(once, None) if once is not None else generator.next
        if make is None:
            break
        talk = make()
        outcome = converse(broker, admin, talk)
        sent += len(talk.chunks)
        kinds[talk.kind] += 1
        outcomes[outcome] += 1
        if talk.hostile and outcome == "welcomed":
            admitted.append(ascii(talk.chunks[0][4:300]))
        if outcome == "open":
            left_open.append(f"{talk.kind}: {talk.chunks[0][:120]!a}")
    return {"sent": sent, "kinds": kinds, "outcomes": outcomes, "admitted": admitted,
            "open": left_open}  # fmt: skip


def campaign(
    agent: AgentProcess, pool: PoolProcess, seconds: float, *, attackers: int = 3, seed: int = 1
) -> Report:
    """Fuzz ``agent`` for ``seconds`` from ``attackers`` processes while ``pool`` holds
    memory it is guaranteed and 100 idle connections stay open; then check the agent, its
    metrics and books, and that the pool kept its lease and can still grow."""
    report = Report()
    broker, admin, gpu = str(agent.broker_socket), str(agent.admin_socket), agent.gpus[0].uuid
    before = pool.status()
    # Each kind once first: the fixed reasons and labels they bring are the baseline.
    _attackers(broker, admin, gpu, 0, [0])
    wait_for_fuzz_pools_to_leave(agent, report)
    baseline = _series(agent)
    idle = []
    for _ in range(100):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(broker)
        idle.append(sock)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(agent, report, stop), daemon=True)
    watcher.start()
    began = time.monotonic()
    for result in _attackers(
        broker, admin, gpu, seconds, [seed * 1000 + i for i in range(attackers)]
    ):
        report.messages_sent += result["sent"]
        report.kinds.update(result["kinds"])
        report.outcomes.update(result["outcomes"])
        report.hostile_admitted += result["admitted"]
        report.left_open += result["open"]
    report.seconds = time.monotonic() - began
    stop.set()
    watcher.join()
    for sock in idle:
        sock.close()
    assert agent.process is not None
    report.crashes = int(agent.process.poll() is not None)
    if report.crashes:
        return report
    wait_for_fuzz_pools_to_leave(agent, report)
    report.new_series = sorted(_series(agent) - baseline)
    after = pool.status()
    report.pool_kept_lease = (
        after["connected"]
        and after["pool_id"] == before["pool_id"]
        and after["used"] == before["used"]
        and after["limit"] >= before["used"]
    )
    pool.demand(before["used"] + 256 * MIB)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not report.pool_grew:
        report.pool_grew = pool.status()["used"] == before["used"] + 256 * MIB
        time.sleep(0.05)
    report.tracebacks = sum("Traceback" in line for line in agent.log)
    return report


def _attackers(
    broker: str, admin: str, gpu: str, seconds: float, seeds: list[int]
) -> list[dict[str, Any]]:
    """Run one attacker process per seed at once; their results."""
    module = [sys.executable, "-m", "tests.deviceplugin.hostile", broker, admin, gpu]
    children = [
        subprocess.Popen(
            [*module, str(seconds), str(seed)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for seed in seeds
    ]
    return [json.loads(child.communicate(timeout=seconds + 60)[0]) for child in children]


def wait_for_fuzz_pools_to_leave(agent: AgentProcess, report: Report) -> None:
    """Pools admitted during the run leave when their connection or process ends."""
    deadline = time.monotonic() + 15
    while any(p.namespace == "fuzz" for p in agent.view().pools):
        if time.monotonic() > deadline:
            report.books_problems.append("pools of the attackers still in the books after 15 s")
            return
        time.sleep(0.05)


if __name__ == "__main__":
    broker_path, admin_path, gpu_uuid, duration, worker_seed = sys.argv[1:6]
    print(json.dumps(attack(broker_path, admin_path, gpu_uuid, float(duration), int(worker_seed))))
