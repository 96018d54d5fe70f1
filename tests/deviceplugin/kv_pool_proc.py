"""A model-server worker for the broker tests: a real :class:`~kvshare.runtime.pool.KVPool`
on the host backend, leased through the real
:class:`~kvshare.runtime.broker_client.BrokerLease`, with an "engine" thread that
allocates and frees blocks to follow a demand given on stdin.

Commands (one JSON object per line; one JSON reply per line):
- ``{"cmd": "demand", "bytes": N}``: the engine wants N bytes of blocks in use: it
  allocates (retrying while the pool is out of lease, as a scheduler would) or frees;
- ``{"cmd": "grab", "bytes": N}``: misbehave: hold N more bytes in a memfd of its own,
  outside the pool and its lease;
- ``{"cmd": "status"}``: lease, pool usage, pool id and name;
- ``{"cmd": "exit"}``: free everything, close the pool (which says goodbye) and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from kvshare.runtime.backends import open_backend
from kvshare.runtime.broker_client import (
    DEFAULT_SLOW_START_WINDOW_S,
    BrokerLease,
    PoolIdentity,
    PoolPolicy,
)
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.pool import KVPool
from kvshare.runtime.pool_lease import DEFAULT_LEASE_CHUNK_BYTES

PAGE = 2 * 2**20


class Engine:
    """Allocates and frees blocks of a pool to follow a demand (its own thread)."""

    def __init__(self, pool: KVPool, block_bytes: int) -> None:
        self.pool = pool
        self.block_bytes = block_bytes
        self.blocks: list[int] = []
        self.cond = threading.Condition()  # guards blocks and demand
        self.demand = 0
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def set_demand(self, nbytes: int) -> None:
        with self.cond:
            self.demand = nbytes // self.block_bytes
            self.cond.notify()

    def used(self) -> int:
        with self.cond:
            return len(self.blocks) * self.block_bytes

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or len(self.blocks) != self.demand, 0.01)
                if self.stopped:
                    return
                short = self.demand - len(self.blocks)
                if short < 0:
                    self.pool.free(self.blocks[short:])
                    del self.blocks[short:]
                    continue
            if short > 0:
                got = self.pool.alloc(min(short, 16))
                if got:
                    with self.cond:
                        self.blocks += got
                else:
                    with self.cond:  # out of lease: the pool asked for more; retry soon
                        self.cond.wait(0.005)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
            if self.blocks:
                self.pool.free(self.blocks)
                self.blocks = []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--pod", default="")
    parser.add_argument("--pod-uid", default="")
    parser.add_argument("--namespace", default="test")
    parser.add_argument("--modelserver", default="")
    parser.add_argument("--static", type=int, default=0)
    parser.add_argument(
        "--capacity", type=int, default=None, help="most it ever asks (default: its kv max)"
    )
    parser.add_argument("--kv-min", type=int, default=0)
    parser.add_argument("--kv-max", type=int, default=None)
    parser.add_argument("--priority", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=None, help="lease growth step, bytes")
    parser.add_argument(
        "--slow-start-window", type=float, default=DEFAULT_SLOW_START_WINDOW_S, metavar="S"
    )
    args = parser.parse_args()
    lease = BrokerLease(
        args.gpu,
        policy=PoolPolicy(
            kv_min=args.kv_min,
            kv_max=args.kv_max,
            priority=args.priority,
            static=args.static,
            page_size=PAGE,
            capacity=args.capacity,
        ),
        identity=PoolIdentity(
            namespace=args.namespace,
            pod=args.pod,
            pod_uid=args.pod_uid,
            modelserver=args.modelserver,
        ),
        socket_path=args.socket,
        report_interval_s=0.01,
        chunk_bytes=args.chunk,
        slow_start_window_s=args.slow_start_window,
    )
    geometry = KVGeometry(num_buffers=1, block_bytes=PAGE, num_blocks=args.blocks + 1,
                          page_size=PAGE)  # fmt: skip
    try:
        pool = KVPool(
            geometry,
            open_backend("host"),
            lease,
            lease_chunk_bytes=args.chunk or DEFAULT_LEASE_CHUNK_BYTES,
        )
    except Exception as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    engine = Engine(pool, PAGE)
    extra = os.memfd_create("misbehaving")
    print(json.dumps({"ready": True, "name": lease.name}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        kind = command["cmd"]
        if kind == "demand":
            engine.set_demand(int(command["bytes"]))
        elif kind == "grab":
            os.ftruncate(extra, int(command["bytes"]))
            os.posix_fallocate(extra, 0, int(command["bytes"]))
        elif kind == "exit":
            engine.stop()
            pool.close()
            print(json.dumps({"bye": True}), flush=True)
            return 0
        snapshot = pool.snapshot()
        reply = {
            "limit": lease.limit(),
            "used": engine.used(),
            "held": snapshot.mapped + snapshot.reserved,
            "pool_id": lease.pool_id,
            "name": lease.name,
            "connected": lease.connected(),
        }
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
