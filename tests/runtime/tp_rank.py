"""One tensor-parallel rank process for the TP tests: ``python -m tests.runtime.tp_rank``.

``--mode local``: builds this rank's own pool (local ownership, the real TP size), allocates
and frees a little, prints what it did as JSON and exits.

``--mode coordinated``: serves this rank's memory to the group's owner (a RankServer on the
host backend), prints ``ready``, then answers commands on stdin, one JSON line each:
``dump`` (the mapped pages, after writing and reading back every block of each through the
engine's tensor view — only while the owner is idle, as an engine touches its KV cache only
when its scheduler runs it), ``state`` (the mapped pages, untouched), ``lower BYTES`` (this
rank's lease is reclaimed), ``reports`` (how many usage reports its lease got, and the
lease in force in the last), ``launch BLOCK`` (a step launched on this rank's device: work
on the backend's stream that reads the block once let run, and the device fence marked, as
the engine's hook marks it), ``finish`` (let it run; answers what it read), ``exit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import Counter

from kvshare.runtime.backends.host import HostBackend
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import StaticLease
from kvshare.runtime.ownership import LocalOwnership
from kvshare.runtime.pool import KVPool
from kvshare.runtime.rank_server import RankServer

from .support import MovableLease

PAGE = 16384
GEOMETRY = KVGeometry(num_buffers=4, block_bytes=4096, num_blocks=400, page_size=PAGE)


class CountingHostBackend(HostBackend):
    """The real host backend, counting map calls per address."""

    def __init__(self) -> None:
        super().__init__()
        self.maps: Counter[int] = Counter()
        self.bases: list[int] = []

    def reserve(self, size: int) -> int:
        base = super().reserve(size)
        self.bases.append(base)
        return base

    def map(self, address: int, size: int, handle: int) -> None:
        self.maps[address] += 1
        super().map(address, size, handle)

    def page0_maps(self) -> list[int]:
        base = self.bases[0]
        return [self.maps[base + offset] for offset, _ in GEOMETRY.page_chunks(0)]


def open_sockets() -> int:
    """Sockets this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def run_local(rank: int, world_size: int) -> None:
    backend = CountingHostBackend()
    ownership = LocalOwnership(rank=rank, world_size=world_size)
    pool = KVPool(GEOMETRY, backend, StaticLease(40 * GEOMETRY.page_bytes), ownership)
    held = [pool.alloc(5 + rank) for _ in range(12)]
    for ids in held[::2]:
        pool.free(ids or [])
    pool.maintain()
    result = {
        "rank": pool.ownership.rank,
        "world_size": pool.ownership.world_size,
        "page0_maps": backend.page0_maps(),
        "max_maps_per_address": max(backend.maps.values()),
        "sockets": open_sockets(),
        "mapped": sorted(pool.mapped_pages()),
    }
    pool.close()
    print(json.dumps(result), flush=True)


def dump(server: RankServer, backend: CountingHostBackend) -> dict[str, object]:
    import torch

    mapped = sorted(server.mapped_pages())
    view = server.tensor(0, GEOMETRY.num_buffers)
    intact = True
    for page in mapped:
        blocks = GEOMETRY.blocks_of(page)
        view[:, blocks.start : blocks.stop, :16] = server.rank + 1
        intact &= bool(torch.all(view[:, blocks.start : blocks.stop, :16] == server.rank + 1))
    return {
        "mapped": mapped,
        "intact": intact,
        "page0_maps": backend.page0_maps(),
        "mapped_bytes": sum(backend.mapped_ranges().values()),
    }


class Step:
    """Device work of one step, reading a block of buffer 0 once the test lets it run."""

    def __init__(self, server: RankServer, block: int) -> None:
        self.view = server.tensor(0)[0, block]
        self.gate = threading.Event()
        self.done = threading.Event()
        self.read: int | None = None

    def __call__(self) -> None:
        self.gate.wait()
        self.read = int(self.view[0])
        self.done.set()


def run_coordinated(args: argparse.Namespace) -> None:
    backend = CountingHostBackend()
    lease = MovableLease(args.limit_pages * GEOMETRY.page_bytes)
    server = RankServer(
        GEOMETRY,
        backend,
        lease,
        group=args.group,
        rank=args.rank,
        world_size=args.world_size,
        namespace=args.namespace,
    )
    print("ready", flush=True)
    step: Step | None = None
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "launch":
            step = Step(server, int(rest[0]))
            step.view[0] = server.rank + 1  # what the step's attention is to read
            backend.launch(step)
            backend.record_fence()
            print(json.dumps({"launched": int(rest[0])}), flush=True)
        elif command == "finish" and step is not None:
            step.gate.set()
            step.done.wait()
            print(json.dumps({"read": step.read}), flush=True)
        elif command == "dump":
            print(json.dumps(dump(server, backend)), flush=True)
        elif command == "state":
            print(json.dumps({"mapped": sorted(server.mapped_pages())}), flush=True)
        elif command == "lower":
            lease.set_limit(int(rest[0]))
            print(json.dumps({"lowered": int(rest[0])}), flush=True)
        elif command == "reports":
            last = lease.reports[-1] if lease.reports else None
            limit = last.limit if last is not None else None
            print(json.dumps({"count": len(lease.reports), "limit": limit}), flush=True)
        elif command == "exit":
            break
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("local", "coordinated"), required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--limit-pages", type=int, default=64)
    args = parser.parse_args()
    if args.mode == "local":
        run_local(args.rank, args.world_size)
    else:
        run_coordinated(args)


if __name__ == "__main__":
    main()
