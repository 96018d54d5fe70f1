"""A pool process for the broker tests: real memory in a memfd, leased through the real
:class:`~kvshare.runtime.broker_client.BrokerLease`, driven by JSON lines on stdin.

Stand-in: it holds memory the way the runtime's host backend does (a memfd whose pages
are allocated and released) without the KV pool's block bookkeeping, so the broker can
be tested with real processes and real memory on its own.

Commands (one JSON object per line; one JSON reply per line):
- ``{"cmd": "demand", "bytes": N}``: the engine wants N bytes: hold up to N within the
  lease, ask for more when N exceeds it, and grow as grants arrive;
- ``{"cmd": "stubborn"}``: from now on ignore reclaims (never shrink, never report);
- ``{"cmd": "grab", "bytes": N}``: misbehave: hold N bytes whatever the lease;
- ``{"cmd": "status"}``: limit, held, the memfd's allocated bytes, pool id and name;
- ``{"cmd": "exit"}``: release everything, say goodbye and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from kvshare.runtime.broker_client import BrokerLease, PoolIdentity, PoolPolicy
from kvshare.runtime.lease import PoolUsage


class MemfdPool:
    """Holds ``held`` bytes of a memfd, never more than its lease (unless stubborn)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.fd = os.memfd_create("kvshare-test-pool")
        self.lock = threading.Lock()  # guards held, demand, stubborn
        self.held = 0
        self.demand = 0
        self.stubborn = False
        self.lease: BrokerLease | None = None

    def _resize(self, target: int) -> None:
        """Allocate or free pages so exactly ``target`` bytes are held."""
        if target > self.held:
            os.ftruncate(self.fd, target)
            os.posix_fallocate(self.fd, self.held, target - self.held)
        elif target < self.held:
            os.ftruncate(self.fd, target)  # frees the pages beyond
        self.held = target

    def settle(self) -> None:
        """Hold min(demand, lease), ask for the rest, report."""
        assert self.lease is not None
        with self.lock:
            limit = self.lease.limit()
            if self.stubborn and self.held > limit:
                return
            target = min(self.demand, limit) // self.page * self.page
            self._resize(target)
            usage = PoolUsage(mapped=self.held, used=self.held, cached=0, reserved=0)
            wants_more = self.demand > limit
        self.lease.report(usage)
        if wants_more:
            self.lease.want(self.demand)

    # LeaseHolder
    def lease_changed(self, limit: int) -> None:
        del limit
        self.settle()

    def allocated(self) -> int:
        return os.fstat(self.fd).st_blocks * 512


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--pod", default="")
    parser.add_argument("--kv-min", type=int, default=0)
    parser.add_argument("--kv-max", type=int, default=None)
    parser.add_argument("--priority", type=int, default=100)
    parser.add_argument("--static", type=int, default=0)
    parser.add_argument("--page", type=int, default=2 * 2**20)
    args = parser.parse_args()
    pool = MemfdPool(args.page)
    lease = BrokerLease(
        args.gpu,
        policy=PoolPolicy(
            kv_min=args.kv_min,
            kv_max=args.kv_max,
            priority=args.priority,
            static=args.static,
            page_size=args.page,
        ),
        identity=PoolIdentity(namespace="test", pod=args.pod),
        socket_path=args.socket,
        report_interval_s=0.01,
    )
    pool.lease = lease
    try:
        lease.attach(pool)
    except Exception as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    print(json.dumps({"ready": True, "limit": lease.limit(), "name": lease.name}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        kind = command["cmd"]
        if kind == "demand":
            with pool.lock:
                pool.demand = int(command["bytes"])
            pool.settle()
        elif kind == "stubborn":
            with pool.lock:
                pool.stubborn = True
        elif kind == "grab":
            with pool.lock:
                pool.stubborn = True
                pool._resize(int(command["bytes"]))
        elif kind == "exit":
            with pool.lock:
                pool.demand = 0
                pool._resize(0)
            lease.close()
            print(json.dumps({"bye": True}), flush=True)
            return 0
        reply = {
            "limit": lease.limit(),
            "held": pool.held,
            "allocated": pool.allocated(),
            "pool_id": lease.pool_id,
            "name": lease.name,
            "connected": lease.connected(),
        }
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
