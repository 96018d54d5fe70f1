"""Benchmark ``broker``: lease grant round trips with 32 concurrent pool processes.

A real ``kvshare node`` (fake 1 TiB GPU, host backend) serves 32 client processes. Each
runs the real broker client (:class:`~kvshare.runtime.broker_client.BrokerLease`) and,
every ``interval`` (randomised around 10 ms), asks for one more page and waits for the
grant: ``grant_rtt`` is the time from ``want()`` to the ``lease_changed`` callback, i.e.
what a pool's allocation path would wait for (the client thread's wake-up, the socket,
the broker, and back). All 32 run at once; ``offered_per_s`` is the aggregate request
rate. The clients hold no memory: the budget is large so every request is granted.

``exit_release_ms``: a pool holding the whole budget is SIGKILLed while another waits;
the time until the waiting pool's lease grows (median of 5).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = 2 * 2**20


def client_main(socket_path: str, gpu: str, requests: int, interval_s: float, seed: int) -> None:
    """One pool process: ``requests`` timed grants, one every ~``interval_s``."""
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
    )
    lease.attach(Holder())
    rng = random.Random(seed)
    samples = []
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    for _ in range(requests):
        time.sleep(rng.uniform(0.5, 1.5) * interval_s)
        granted.clear()
        start = time.perf_counter()
        lease.want(lease.limit() + 1)
        if not granted.wait(10):
            raise SystemExit("no grant within 10 s")
        samples.append((granted_at[0] - start) * 1e6)
    lease.close()
    print(json.dumps(samples), flush=True)


class Agent:
    """``kvshare node`` in a subprocess, with its sockets in a temp dir."""

    def __init__(self, fake_gpus: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.socket = self.dir / "broker.sock"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "node", "--fake-gpus", fake_gpus,
             "--node-name", "bench", "--headroom", "1Gi", "--broker-socket", str(self.socket),
             "--device-plugin-dir", str(self.dir / "none"), "--metrics-address", "127.0.0.1:0",
             "--no-kube"],
            cwd=ROOT, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if re.search(r"metrics http://", line):
                break
        threading.Thread(target=self.process.stderr.read, daemon=True).start()
        from kvshare.deviceplugin.inventory import parse_fake_gpus

        self.gpu = parse_fake_gpus(fake_gpus, "bench")[0].uuid

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    # -P: bench/ must not come first on sys.path (bench/operator.py would shadow `operator`).
    return subprocess.Popen(
        [sys.executable, "-P", __file__, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def measure_grants(pools: int, requests: int, interval_s: float) -> tuple[list[float], float]:
    """Per-request grant RTTs (µs) of ``pools`` concurrent clients, and the wall time."""
    agent = Agent("1x1024Gi")
    try:
        clients = [
            _spawn(
                ["--client", str(agent.socket), agent.gpu, str(requests), str(interval_s), str(i)]
            )
            for i in range(pools)
        ]
        for client in clients:
            assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        samples: list[float] = []
        for client in clients:
            assert client.stdout is not None
            samples += json.loads(client.stdout.readline())[20:]  # drop warm-up
            client.wait(30)
        return samples, time.perf_counter() - start
    finally:
        agent.stop()


def holder_main(socket_path: str, gpu: str, nbytes: int) -> None:
    """A pool that takes ``nbytes`` (or waits for them) and prints each lease it gets."""
    from kvshare.runtime.broker_client import BrokerLease, PoolPolicy
    from kvshare.runtime.lease import PoolUsage

    class Holder:
        def lease_changed(self, limit: int) -> None:
            print(limit, flush=True)
            lease.report(PoolUsage(mapped=0, used=0, cached=0, reserved=0))

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
    try:
        for _ in range(trials):
            victim = _spawn(["--hold", str(agent.socket), agent.gpu, str(budget)])
            assert victim.stdout is not None
            while int(victim.stdout.readline()) < budget:
                pass
            waiter = _spawn(["--hold", str(agent.socket), agent.gpu, str(PAGE)])
            assert waiter.stdout is not None and int(waiter.stdout.readline()) == 0
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
        agent.stop()
    return results


def run(quick: bool):  # type: ignore[no-untyped-def]
    from harness import Result, Target, percentile

    pools, requests, interval = (32, 150, 0.01) if quick else (32, 500, 0.01)
    samples, wall = measure_grants(pools, requests, interval)
    exits = measure_exit_release(3 if quick else 5)
    return Result(
        name="broker",
        fields={
            "pools": pools,
            "requests": len(samples),
            "offered_per_s": round(pools * requests / wall),
            "grant_rtt_p50_us": round(percentile(samples, 50), 1),
            "grant_rtt_p99_us": round(percentile(samples, 99), 1),
            "grant_rtt_max_us": round(max(samples), 1),
            "exit_release_ms": round(statistics.median(exits), 1),
        },
        targets=[
            Target("grant_rtt_p50_us", "<=", 150),
            Target("grant_rtt_p99_us", "<=", 1000),
            Target("exit_release_ms", "<=", 1000),
        ],
        notes=f"32 pool processes + kvshare node on {os.cpu_count()} cores; a request every "
        f"~{interval * 1e3:.0f} ms per pool, want() to lease_changed() through BrokerLease",
    )


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                    int(sys.argv[6]))  # fmt: skip
    elif sys.argv[1] == "--hold":
        holder_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
