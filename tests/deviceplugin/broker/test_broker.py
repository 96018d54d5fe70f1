"""The memory broker with real processes: ``kvshare node`` (fake GPU, host backend) and
pool processes holding real memfd memory through the real broker client."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvshare.api.wire import BROKER_CODEC, MAX_FRAME_BYTES, Bye, Hello, Refused, Want, Welcome
from kvshare.deviceplugin.broker.audit import memfd_bytes
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.runtime.broker_client import startup_turn
from tests.deviceplugin.conftest import (
    GIB,
    MIB,
    ROOT,
    AgentProcess,
    PoolProcess,
    check_engines_take_turns,
    kvshare_cli,
    wait_until,
)

# 2 GiB fake GPU, 256 MiB headroom: pools share a 1.75 GiB budget.
GPU_SPEC = "1x2Gi"
HEADROOM = ("--headroom", "256Mi")
BUDGET = 2 * GIB - 256 * MIB

AgentFactory = Callable[..., AgentProcess]
PoolFactory = Callable[..., PoolProcess]


@contextmanager
def memory_watch(pools: list[PoolProcess]) -> Iterator[list[int]]:
    """Sample what the pools' processes really hold (their memfds, read from /proc) every
    few milliseconds; yields the list of sums, filled until the block ends."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(sum(memfd_bytes(p.pid) or 0 for p in pools))
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def uses(pool: PoolProcess, nbytes: int) -> Callable[[], bool]:
    """The pool's engine has ``nbytes`` of blocks in use."""
    return lambda: pool.status()["used"] == nbytes


def test_two_pools_trade_memory_under_a_scripted_load_without_over_committing(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a", kv_min=128 * MIB)
    b = pool_factory(agent, "b", kv_min=128 * MIB)
    with memory_watch([a, b]) as samples:
        # A's traffic peaks: it borrows everything B is not guaranteed.
        a.demand(BUDGET)
        wait_until(lambda: a.status()["limit"] == BUDGET - 128 * MIB, what="A to borrow")
        wait_until(lambda: a.status()["used"] >= 1536 * MIB, what="A to use what it borrowed")
        # A's traffic drops, B's rises: A gives back, B grows into what A released.
        a.demand(256 * MIB)
        b.demand(1280 * MIB)
        wait_until(uses(b, 1280 * MIB), what="B to grow into A's memory")
        # And back again: B's load drops, A's rises.
        b.demand(256 * MIB)
        a.demand(1280 * MIB)
        wait_until(uses(a, 1280 * MIB), what="A to take the memory back")
    assert samples, "the memory watch took no samples"
    assert max(samples) <= BUDGET, f"pools held {max(samples)} > budget {BUDGET}"
    view = agent.view()
    assert view.gpus[0].unleased >= 0
    assert sum(p.charged for p in view.pools) <= BUDGET
    for pool in (a, b):
        status = pool.status()
        assert status["held"] <= status["limit"]
    metrics = agent.metrics()
    assert 'kvshare_broker_reclaims_total{gpu="' in metrics
    assert "kvshare_broker_reclaim_seconds_count" in metrics


def reclaims_sent(agent: AgentProcess) -> int:
    """``kvshare_broker_reclaims_total`` of the agent's (only) GPU."""
    for line in agent.metrics().splitlines():
        if line.startswith("kvshare_broker_reclaims_total{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_burst_takes_a_quiet_neighbours_idle_lease_in_a_few_rounds(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    """Both pools grow one page (2 MiB) at a time when they grow slowly. The quiet pool's
    past peak left it a lease it no longer uses; the bursting pool gets that memory in a
    number of reclaims logarithmic in the amount (its wants double while it keeps running
    out), not one per page, while the quiet pool keeps its blocks in use."""
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    growth = {"chunk": 2 * MIB, "slow_start_window": 30.0}  # 30 s: robust on a loaded host
    quiet = pool_factory(agent, "quiet", **growth)
    quiet.demand(1024 * MIB)
    wait_until(uses(quiet, 1024 * MIB), what="the quiet pool's past peak")
    quiet.demand(128 * MIB)
    wait_until(uses(quiet, 128 * MIB), what="the quiet pool to go quiet")
    lent = quiet.status()["limit"]
    assert lent >= 1024 * MIB, "the lease stays until someone needs it"
    before = reclaims_sent(agent)
    busy = pool_factory(agent, "busy", **growth)
    with memory_watch([quiet, busy]) as samples:
        busy.demand(1536 * MIB)
        wait_until(uses(busy, 1536 * MIB), what="the burst to get the idle lease")
    rounds = reclaims_sent(agent) - before
    moved_pages = (1536 * MIB - (BUDGET - lent)) // (2 * MIB)  # from the quiet pool's lease
    assert 1 <= rounds <= moved_pages.bit_length() + 2, f"{rounds} reclaims for {moved_pages}"
    status = quiet.status()
    assert status["used"] == 128 * MIB and status["held"] <= status["limit"]
    assert max(samples) <= BUDGET


def test_a_killed_pool_returns_its_lease_within_a_second(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    victim = pool_factory(agent, "victim")
    waiter = pool_factory(agent, "waiter", kv_min=16 * MIB)
    # The victim fills every page the GPU has left (page 0 holds its null block): a
    # reclaim can only wait for its blocks.
    whole = BUDGET - 16 * MIB - 2 * MIB
    victim.demand(whole)
    wait_until(uses(victim, whole), what="the victim to use its whole lease")
    waiter.demand(512 * MIB)  # nothing unleased, nothing idle: it waits
    assert waiter.status()["limit"] == 16 * MIB
    victim.kill()
    killed_at = time.monotonic()
    wait_until(lambda: "test/victim" not in agent.pools(), 10, "the lease to return")
    returned_after = time.monotonic() - killed_at
    wait_until(uses(waiter, 512 * MIB), what="the waiter to get the freed memory")
    assert returned_after < 1.0, f"lease returned {returned_after:.2f} s after SIGKILL"
    departures = [
        line
        for line in agent.metrics().splitlines()
        if line.startswith("kvshare_broker_departures_total")
    ]
    assert any('reason="process exited"' in line for line in departures), departures


def test_broker_killed_mid_load_rebuilds_its_books_from_the_pools(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a", kv_min=128 * MIB)
    b = pool_factory(agent, "b", kv_min=128 * MIB, priority=300)
    a.demand(768 * MIB)
    b.demand(512 * MIB)
    wait_until(uses(a, 768 * MIB), what="A's load")
    wait_until(uses(b, 512 * MIB), what="B's load")
    mins = {p.name: p.kv_min for p in agent.view().pools}

    agent.stop(signal.SIGKILL)
    # The pools keep their memory, leases and blocks while the broker is away.
    for pool in (a, b):
        wait_until(lambda p=pool: not p.status()["connected"], what="the pools to notice")
    down = {s["name"]: s for s in (a.status(), b.status())}
    for pool in (a, b):
        status = pool.status()
        assert status["limit"] == down[status["name"]]["limit"]
        assert (memfd_bytes(pool.pid) or 0) >= status["used"] > 0
    agent.start()

    def rebuilt() -> bool:
        view = agent.try_view()
        return view is not None and len(view.pools) == 2 and not view.recovering

    wait_until(rebuilt, what="both pools to re-declare")
    view = agent.view()
    # The books are rebuilt from what the pools declared: same leases, same minimums.
    assert {p.name: p.lease for p in view.pools} == {n: s["limit"] for n, s in down.items()}
    assert {p.name: p.kv_min for p in view.pools} == mins
    assert sum(p.lease for p in view.pools) == sum(s["limit"] for s in down.values())
    assert view.gpus[0].unleased >= 0
    # The rebuilt broker keeps lending: A can still grow into what is unleased.
    a.demand(1024 * MIB)
    wait_until(uses(a, 1024 * MIB), what="A to grow after the restart")


def _malformed_frames() -> Iterator[bytes]:
    """1,000 frames that each break the protocol in one way."""
    hello = json.loads(
        BROKER_CODEC.encode(
            Hello(version=1, gpu="GPU-x", page_size=2 * MIB, kv_min=0, kv_max=None,
                  priority=1, static=0)
        )[4:]
    )  # fmt: skip

    def frame(payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + payload

    kinds = [
        struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 64,  # oversized
        struct.pack(">I", 0),  # empty frame
        frame(b"\xff\xfe not json"),
        frame(b"[1, 2, 3]"),
        frame(b'{"type": "grant-me-everything"}'),
        frame(json.dumps({**hello, "priority": "high"}).encode()),
        frame(json.dumps({**hello, "pool_id": 1}).encode()),
        frame(BROKER_CODEC.encode(Want(seq=1, total=GIB))[4:]),  # before hello
        frame(json.dumps({"type": "report", "mapped": -1}).encode()),
        frame(b'{"type": "hello"}'),
    ]
    for i in range(1000):
        yield kinds[i % len(kinds)]


def test_a_thousand_malformed_frames_close_only_their_connections(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a")
    a.demand(512 * MIB)
    wait_until(uses(a, 512 * MIB), what="A's load")
    before = a.status()
    refused = 0
    for bad in _malformed_frames():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rogue:
            rogue.settimeout(10)
            rogue.connect(str(agent.broker_socket))
            rogue.sendall(bad)
            answer = b""
            while chunk := rogue.recv(65536):
                answer += chunk  # the broker answers why, then closes
            refused += b"protocol error" in answer
    assert refused == 1000
    counted = [
        float(line.rsplit(" ", 1)[1])
        for line in agent.metrics().splitlines()
        if line.startswith("kvshare_broker_protocol_errors_total{")
    ]
    assert sum(counted) == 1000
    # The broker and the pool are unaffected: same connection, same lease, still growing.
    after = a.status()
    assert after["connected"] and after["pool_id"] == before["pool_id"]
    assert agent.pools()["test/a"].lease == before["limit"]
    a.demand(1024 * MIB)
    wait_until(uses(a, 1024 * MIB), what="A to keep growing")


def test_a_pool_cannot_touch_another_pools_lease(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a")
    a.demand(1024 * MIB)
    wait_until(uses(a, 1024 * MIB), what="A's load")
    a_lease = a.status()["limit"]
    a_id = a.status()["pool_id"]
    gpu = agent.gpus[0].uuid

    def converse(*messages: bytes) -> list[object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rogue:
            rogue.settimeout(10)
            rogue.connect(str(agent.broker_socket))
            for message in messages:
                rogue.sendall(message)
            rogue.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := rogue.recv(65536):
                data += chunk
        replies, offset = [], 0
        while offset < len(data):
            (length,) = struct.unpack_from(">I", data, offset)
            replies.append(BROKER_CODEC.decode(data[offset + 4 : offset + 4 + length]))
            offset += 4 + length
        return replies

    own = Hello(version=1, gpu=gpu, page_size=2 * MIB, kv_min=0, kv_max=None, priority=1000,
                static=0, namespace="test", pod="rogue")  # fmt: skip
    # 1. Naming another pool in a request is not part of the protocol: disconnected.
    want_for_a = json.dumps({"type": "want", "seq": 1, "total": BUDGET, "pool_id": a_id})
    replies = converse(BROKER_CODEC.encode(own), struct.pack(">I", len(want_for_a)) +
                       want_for_a.encode())  # fmt: skip
    assert isinstance(replies[0], Welcome) and replies[0].pool_id != a_id
    assert isinstance(replies[-1], Refused) and "unknown fields ['pool_id']" in replies[-1].reason
    # 2. Claiming to be A, re-declaring a huge lease: it becomes a pool of its own that
    #    gets only unleased memory; A is neither touched nor reclaimed.
    impostor = Hello(version=1, gpu=gpu, page_size=2 * MIB, kv_min=0, kv_max=None,
                     priority=1000, static=0, namespace="test", pod="a", resume=True,
                     held=BUDGET, lease=BUDGET)  # fmt: skip
    replies = converse(BROKER_CODEC.encode(impostor), BROKER_CODEC.encode(Bye()))
    assert isinstance(replies[0], Welcome)
    assert replies[0].pool_id != a_id and replies[0].lease <= BUDGET - a_lease
    assert replies[0].name != "test/a"
    # A's lease and memory never moved.
    wait_until(lambda: replies[0].name not in agent.pools(), what="the impostor to leave")
    pools = agent.pools()
    assert pools["test/a"].lease == a_lease and pools["test/a"].reclaim_target is None
    status = a.status()
    assert status["limit"] == a_lease and status["used"] == 1024 * MIB


def test_a_pool_that_misses_the_reclaim_deadline_is_reported_not_ignored(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM, "--reclaim-deadline", "0.5")
    # It never asks beyond 1.25 GiB (its asks grow geometrically while it keeps running
    # out): the other pool has room to start.
    hog = pool_factory(agent, "hog", priority=10, capacity=1280 * MIB)
    hog.demand(1024 * MIB)
    wait_until(uses(hog, 1024 * MIB), what="the hog's load")
    hog.demand(0)  # its load is gone, its lease stays: a fair broker reclaims it ...
    wait_until(uses(hog, 0), what="the hog to free its blocks")
    hog_lease = hog.status()["limit"]
    print("HOG", hog_lease / MIB, agent.pools()["test/hog"])
    os.kill(hog.pid, signal.SIGSTOP)  # ... but the hog hangs and never answers
    try:
        other = pool_factory(agent, "other", priority=500)
        with memory_watch([hog, other]) as samples:
            other.demand(1536 * MIB)
            wait_until(lambda: agent.pools()["test/hog"].reclaim_overdue, what="the deadline")
            # The memory still charged to the hog is never handed to the other pool.
            assert agent.pools()["test/other"].lease <= BUDGET - hog_lease
        metrics = agent.metrics()
        assert 'kvshare_broker_reclaim_deadline_missed_total{gpu="' in metrics
        overdue = [
            line
            for line in metrics.splitlines()
            if line.startswith("kvshare_pool_reclaim_overdue{") and 'pool="test/hog"' in line
        ]
        assert overdue and overdue[0].endswith(" 1.0")
        ctl = subprocess.run(
            [sys.executable, "-m", "kvshare.cli", "ctl", "--admin-socket",
             str(agent.admin_socket), "pools"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "OVERDUE" in ctl.stdout
        assert max(samples) <= BUDGET
    finally:
        os.kill(hog.pid, signal.SIGCONT)
    # Late is better than never: the release completes the reclaim and clears the flag.
    wait_until(lambda: not agent.pools()["test/hog"].reclaim_overdue, what="the late release")
    wait_until(uses(other, 1536 * MIB), what="the other pool to grow")


def test_a_pool_holding_more_than_its_lease_is_flagged_by_the_audit(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM, "--audit-interval", "0.1")
    greedy = pool_factory(agent, "greedy")
    greedy.demand(256 * MIB)
    wait_until(uses(greedy, 256 * MIB), what="its load")
    status = greedy.status()
    room = status["limit"] - status["held"]
    greedy.send(cmd="grab", bytes=room + 4 * MIB)  # two pages more than the lease allows
    wait_until(lambda: agent.pools()["test/greedy"].over_lease, what="the audit to flag it")
    assert agent.pools()["test/greedy"].device_bytes == status["limit"] + 4 * MIB
    flagged = [
        line
        for line in agent.metrics().splitlines()
        if line.startswith("kvshare_pool_over_lease{") and 'pool="test/greedy"' in line
    ]
    assert flagged and flagged[0].endswith(" 1.0")
    greedy.send(cmd="grab", bytes=room)  # back within the lease
    wait_until(lambda: not agent.pools()["test/greedy"].over_lease, what="the flag to clear")


def test_startup_turns_are_given_one_at_a_time_per_gpu(agent_factory: AgentFactory) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    gpu = agent.gpus[0].uuid
    check_engines_take_turns(
        agent,
        lambda: startup_turn(
            gpu, static_bytes=256 * MIB, socket_path=str(agent.broker_socket), timeout_s=30
        ),
        static_bytes=256 * MIB,
    )
    assert agent.view().gpus[0].static == 0


def test_admin_sets_a_max_and_drains_a_gpu(
    agent_factory: AgentFactory, pool_factory: PoolFactory
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a", kv_min=128 * MIB)
    a.demand(1024 * MIB)
    wait_until(uses(a, 1024 * MIB), what="A's load")
    a.demand(256 * MIB)
    wait_until(uses(a, 256 * MIB), what="A's load to drop")
    agent.admin(AdminRequest(op="set-max", pool="test/a", size=512 * MIB))
    wait_until(lambda: a.status()["limit"] == 512 * MIB, what="A's lease to follow its max")
    wait_until(lambda: agent.pools()["test/a"].reclaim_target is None, what="A to release")
    assert a.status()["held"] <= 512 * MIB and agent.pools()["test/a"].kv_max == 512 * MIB
    a.demand(64 * MIB)
    agent.admin(AdminRequest(op="drain", gpu="0"))
    wait_until(lambda: a.status()["limit"] == 128 * MIB, what="A's lease down to its min")
    wait_until(lambda: agent.pools()["test/a"].reclaim_target is None, what="A to release")
    late = pool_factory(agent, "late")
    assert late.error is not None and "draining" in late.error
    agent.admin(AdminRequest(op="undrain", gpu="0"))
    a.demand(448 * MIB)
    wait_until(uses(a, 448 * MIB), what="A to grow again, up to its max")
    assert a.status()["limit"] <= 512 * MIB


def test_sigterm_stops_the_agent_cleanly_and_removes_its_sockets(
    agent_factory: AgentFactory,
) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    # The device plugin's thread says so on its own time, maybe after the agent serves.
    wait_until(
        lambda: "the device plugin waits for a kubelet" in "".join(agent.log),
        what="the device plugin's line",
    )
    assert agent.broker_socket.exists() and agent.admin_socket.exists()
    assert agent.stop(signal.SIGTERM) == 0
    assert not agent.broker_socket.exists() and not agent.admin_socket.exists()


@pytest.mark.parametrize("gpus", ["banana", "3xQuarterGi"])
def test_a_bad_fake_inventory_is_a_clear_error(gpus: str, short_tmp: object) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "node", "--fake-gpus", gpus, "--no-kube",
         "--broker-socket", f"{short_tmp}/run/b.sock", "--admin-dir", f"{short_tmp}/admin",
         "--metrics-address", "127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "--fake-gpus" in done.stderr and "kvshare node cannot start" in done.stderr


def test_ctl_and_top_show_the_books(agent_factory: AgentFactory, pool_factory: PoolFactory) -> None:
    agent = agent_factory(GPU_SPEC, *HEADROOM)
    a = pool_factory(agent, "a", kv_min=128 * MIB, kv_max=1024 * MIB)
    a.demand(256 * MIB)
    wait_until(uses(a, 256 * MIB), what="A's load")
    admin = ("--admin-socket", str(agent.admin_socket))
    pools = kvshare_cli("ctl", *admin, "pools")
    assert pools.returncode == 0, pools.stderr
    header, row = pools.stdout.splitlines()[:2]
    assert header.split() == ["ID", "POOL", "GPU", "PRIO", "MIN", "MAX", "LEASE", "MAPPED",
                              "USED", "DEVICE", "FLAGS"]  # fmt: skip
    assert row.split()[1:6] == ["test/a", "0", "100", "128.0Mi", "1.0Gi"]
    gpus = kvshare_cli("ctl", *admin, "gpus")
    assert agent.gpus[0].uuid in gpus.stdout and "healthy" in gpus.stdout
    listed = json.loads(kvshare_cli("ctl", *admin, "--json", "pools").stdout)
    assert [p["name"] for p in listed["pools"]] == ["test/a"]
    top = kvshare_cli("top", *admin, "--iterations", "2", "--interval", "0.1")
    assert top.returncode == 0 and top.stdout.count("kvshare top") == 2 and "test/a" in top.stdout
    unknown = kvshare_cli("ctl", *admin, "set-max", "nobody", "1Gi")
    assert unknown.returncode == 1 and "no pool 'nobody'" in unknown.stderr
    missing = kvshare_cli("ctl", "--admin-socket", str(agent.directory / "nope.sock"), "pools")
    assert missing.returncode == 1 and "is `kvshare node` running here?" in missing.stderr
