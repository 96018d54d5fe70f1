"""One rank of a TP=2 engine starting up under the broker: ``python -m tests.engines.tp_start``.

Does what an engine's rank does at start-up: takes its GPU's start-up turn (as the engine
hooks take it, naming the engine's group), and inside it runs the group's collective
set-up — a real ``torch.distributed`` process group (gloo) with its peer rank, and one
all-reduce. Prints ``asking`` before it asks, then one JSON line when it is through.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvshare.runtime.engines import pools
from kvshare.runtime.engines.pools import Role


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the group's rendezvous port")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    print("asking", flush=True)
    began = time.monotonic()
    with pools.startup_turn(Role("vllm", args.rank, 2, "coordinated"), group="engine"):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=2,
            timeout=timedelta(seconds=args.timeout),
        )
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.destroy_process_group()
    result = {"rank": args.rank, "through_s": round(time.monotonic() - began, 2)}
    print(json.dumps({**result, "peers": int(total.item())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
