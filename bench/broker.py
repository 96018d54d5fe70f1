"""Benchmark ``broker``: lease grant round trips with 32 concurrent pools.

A real ``kvshare node`` (fake 1 TiB GPU, host backend, every part of the agent running)
serves 32 pools at once; each asks for one more page every ~10 ms (uniformly 5-15 ms)
and waits for the grant. The budget is large, so every request is granted.

- ``grant_rtt_*``: 32 client threads in one process, each on its own connection speaking
  the wire protocol as a pool does (``Want`` out, ``Lease`` back), timed at the socket:
  the broker's round trip.
- ``lease_rtt_*``: 32 pool *processes* through the real broker client (``BrokerLease``),
  from ``want()`` to the ``lease_changed`` callback: what a pool's own background thread
  sees, including the client's thread hops and 33 processes on the machine's cores.
- ``ipc_floor_*``: the same pacing on a bare unix-socket ping-pong between two
  processes, measured in the same run: what the machine charges for waking a process,
  without any kvshare code.
- ``exit_release_ms``: a pool holding the whole budget is SIGKILLed while another waits;
  time until the waiting pool's lease grows (median of 5).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = 2 * 2**20
POOLS = 32
INTERVAL_S = 0.01
WARM_UP = 20


def _pace(rng: random.Random) -> None:
    time.sleep(rng.uniform(0.5, 1.5) * INTERVAL_S)


class Agent:
    """``kvshare node`` in a subprocess, with its sockets in a temp dir."""

    def __init__(self, fake_gpus: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.socket = self.dir / "run" / "broker.sock"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "node", "--fake-gpus", fake_gpus,
             "--node-name", "bench", "--headroom", "1Gi", "--broker-socket", str(self.socket),
             "--admin-dir", str(self.dir / "admin"),
             "--device-plugin-dir", str(self.dir / "none"), "--metrics-address", "127.0.0.1:0",
             "--no-kube"],
            cwd=ROOT, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if "metrics http://" in line:
                break
        threading.Thread(target=self.process.stderr.read, daemon=True).start()
        from kvshare.deviceplugin.inventory import parse_fake_gpus

        self.gpu = parse_fake_gpus(fake_gpus, "bench")[0].uuid

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- grant_rtt: 32 threads on the wire -----------------------------------------------------


def _wire_pool(agent: Agent, index: int, requests: int, start: threading.Event) -> list[float]:
    from kvshare.api.wire import BROKER_CODEC, FrameReader, Hello, Lease, Want, Welcome

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(agent.socket))
        reader = FrameReader()

        def receive() -> object:
            while True:
                payloads = reader.feed(sock.recv(1 << 16))
                if payloads:
                    return BROKER_CODEC.decode(payloads[0])

        hello = Hello(version=1, gpu=agent.gpu, page_size=PAGE, kv_min=0, kv_max=None,
                      priority=100, static=0, namespace="bench", pod=f"wire-{index}")  # fmt: skip
        sock.sendall(BROKER_CODEC.encode(hello))
        assert isinstance(receive(), Welcome)
        rng = random.Random(index)
        samples = []
        start.wait()
        for seq in range(1, requests + 1):
            _pace(rng)
            began = time.perf_counter()
            sock.sendall(BROKER_CODEC.encode(Want(seq=seq, total=seq * PAGE)))
            reply = receive()
            samples.append((time.perf_counter() - began) * 1e6)
            assert isinstance(reply, Lease) and reply.limit == seq * PAGE
    return samples[WARM_UP:]


def measure_wire(agent: Agent, requests: int) -> tuple[list[float], float]:
    """Grant RTTs (µs) of POOLS concurrent wire clients, and the aggregate request rate."""
    results: list[list[float]] = [[] for _ in range(POOLS)]
    start = threading.Event()

    def run_one(i: int) -> None:
        results[i] = _wire_pool(agent, i, requests, start)

    threads = [threading.Thread(target=run_one, args=(i,)) for i in range(POOLS)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    began = time.perf_counter()
    start.set()
    for thread in threads:
        thread.join()
    rate = POOLS * requests / (time.perf_counter() - began)
    return [s for r in results for s in r], rate


# --- lease_rtt: 32 processes through BrokerLease -------------------------------------------


def client_main(socket_path: str, gpu: str, requests: int, seed: int) -> None:
    """One pool process: ``requests`` timed grants through BrokerLease."""
    from kvshare.runtime.broker_client import BrokerLease, PoolIdentity, PoolPolicy

    granted = threading.Event()
    granted_at = [0.0]

    class Holder:
        def lease_changed(self, limit: int) -> None:
            granted_at[0] = time.perf_counter()  # the moment the pool learns of the grant
            granted.set()

    lease = BrokerLease(
        gpu,
        policy=PoolPolicy(page_size=PAGE),
        identity=PoolIdentity(namespace="bench", pod=f"pool-{seed}"),
        socket_path=socket_path,
        chunk_bytes=PAGE,
        # One page per request, as before slow start: this measures round trips, and its
        # wants come every ~10 ms whatever the pool uses (a real pool's do not).
        slow_start_window_s=0.0,
    )
    lease.attach(Holder())
    rng = random.Random(seed)
    samples = []
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    for _ in range(requests):
        _pace(rng)
        granted.clear()
        start = time.perf_counter()
        lease.want(lease.limit() + 1)
        if not granted.wait(10):
            raise SystemExit("no grant within 10 s")
        samples.append((granted_at[0] - start) * 1e6)
    lease.close()
    print(json.dumps(samples[WARM_UP:]), flush=True)


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    # -P: bench/ must not come first on sys.path (bench/operator.py would shadow `operator`).
    return subprocess.Popen(
        [sys.executable, "-P", __file__, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def measure_processes(agent: Agent, requests: int) -> list[float]:
    """Grant RTTs (µs) of POOLS concurrent pool processes through BrokerLease."""
    clients = [
        _spawn(["--client", str(agent.socket), agent.gpu, str(requests), str(i)])
        for i in range(POOLS)
    ]
    for client in clients:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
    samples: list[float] = []
    for client in clients:
        assert client.stdout is not None
        samples += json.loads(client.stdout.readline())
        client.wait(30)
    return samples


# --- ipc_floor: the machine's own wake-up cost ---------------------------------------------


def measure_floor(requests: int) -> list[float]:
    """A bare two-process unix socket ping-pong with the same pacing (µs)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        while data := theirs.recv(64):
            theirs.send(data)
        os._exit(0)
    theirs.close()
    rng = random.Random(0)
    samples = []
    for _ in range(requests):
        _pace(rng)
        began = time.perf_counter()
        ours.send(b"x")
        ours.recv(64)
        samples.append((time.perf_counter() - began) * 1e6)
    ours.close()
    os.waitpid(pid, 0)
    return samples[WARM_UP:]


# --- exit_release --------------------------------------------------------------------------


def holder_main(socket_path: str, gpu: str, nbytes: int) -> None:
    """A pool that takes ``nbytes`` (or waits for them) and prints each lease it gets.

    Everything it is granted stays in use, as in a pool whose requests are all running: a
    reclaim (the broker asks for the waiting pool's fair share) is taken in, reported, and
    not met, so the only way the waiting pool gets memory is this process's exit.
    """
    from kvshare.runtime.broker_client import BrokerLease, PoolPolicy
    from kvshare.runtime.lease import PoolUsage

    held = 0

    class Holder:
        def lease_changed(self, limit: int) -> None:
            nonlocal held
            print(limit, flush=True)
            held = max(held, limit)
            lease.report(PoolUsage(mapped=held, used=held, cached=0, reserved=0, limit=limit))

    lease = BrokerLease(gpu, policy=PoolPolicy(page_size=PAGE), socket_path=socket_path)
    lease.attach(Holder())
    lease.want(nbytes)
    print(lease.limit(), flush=True)
    sys.stdin.readline()


def measure_exit_release(trials: int) -> list[float]:
    """Milliseconds from SIGKILL of a pool to the grant of its memory to a waiting pool."""
    agent = Agent("1x4Gi")
    budget = 3 * 2**30
    results = []
    children: list[subprocess.Popen[str]] = []
    try:
        for _ in range(trials):
            victim = _spawn(["--hold", str(agent.socket), agent.gpu, str(budget)])
            children.append(victim)
            assert victim.stdout is not None
            while int(victim.stdout.readline()) < budget:
                pass
            waiter = _spawn(["--hold", str(agent.socket), agent.gpu, str(PAGE)])
            children.append(waiter)
            assert waiter.stdout is not None
            first = int(waiter.stdout.readline())
            assert first == 0, f"the waiting pool got {first} bytes before the kill"
            start = time.perf_counter()
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(30)
            while int(waiter.stdout.readline()) < PAGE:
                pass
            results.append((time.perf_counter() - start) * 1e3)
            waiter.kill()
            waiter.wait(30)
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(30)
        agent.stop()
    return results


def run(quick: bool):  # type: ignore[no-untyped-def]
    from harness import Result, Target, percentile

    requests = 150 if quick else 500
    agent = Agent("1x1024Gi")
    try:
        wire, rate = measure_wire(agent, requests)
    finally:
        agent.stop()
    agent = Agent("1x1024Gi")
    try:
        processes = measure_processes(agent, requests)
    finally:
        agent.stop()
    floor = measure_floor(requests)
    exits = measure_exit_release(3 if quick else 5)
    return Result(
        name="broker",
        fields={
            "pools": POOLS,
            "requests": len(wire),
            "offered_per_s": round(rate),
            "grant_rtt_p50_us": round(percentile(wire, 50), 1),
            "grant_rtt_p99_us": round(percentile(wire, 99), 1),
            "lease_rtt_p50_us": round(percentile(processes, 50), 1),
            "lease_rtt_p99_us": round(percentile(processes, 99), 1),
            "ipc_floor_p50_us": round(percentile(floor, 50), 1),
            "ipc_floor_p99_us": round(percentile(floor, 99), 1),
            "exit_release_ms": round(statistics.median(exits), 1),
        },
        targets=[
            Target("grant_rtt_p50_us", "<=", 150),
            Target("grant_rtt_p99_us", "<=", 1000),
            Target("exit_release_ms", "<=", 1000),
        ],
        notes=f"kvshare node + 32 pools on {os.cpu_count()} cores, a request every 5-15 ms "
        "per pool; grant_rtt: 32 threads on the wire; lease_rtt: 32 processes through "
        "BrokerLease; ipc_floor: bare 2-process ping-pong, same pacing",
    )


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "--hold":
        holder_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
