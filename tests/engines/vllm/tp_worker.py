"""One vLLM tensor-parallel worker for the TP test: ``python -m tests.engines.vllm.tp_worker``.

Builds its KV cache through vLLM's (patched) ``allocate_kv_cache`` inside its group, which
serves this rank's memory to the scheduler's pool, prints ``ready``, then answers one
JSON line per command on stdin: ``state`` (mapped pages), ``read BLOCK`` (the first byte of
that block in layer 0, through vLLM's view, written beforehand by ``write BLOCK VALUE``),
``exit``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvshare.runtime.engines import pools, vllm_common
from kvshare.runtime.engines.activation import activate
from kvshare.runtime.rank_server import RankServer
from tests.engines.vllm.kv_setup import LAYERS, VIRTUAL, allocate, kv_cache_config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args()

    activate("vllm")
    config, layout, _ = kv_cache_config(VIRTUAL)
    group = vllm_common.Group(args.group, args.world_size)
    with vllm_common.worker_context(group, args.rank):
        views = allocate(config, layout)
    server = next(item for item in pools._opened if isinstance(item, RankServer))
    layer0 = views[LAYERS[0]]
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "state":
            reply: object = sorted(server.mapped_pages())
        elif command == "write":
            layer0[int(rest[0])].view(torch.uint8).fill_(int(rest[1]))
            reply = "ok"
        elif command == "read":
            reply = int(layer0[int(rest[0])].view(torch.uint8).flatten()[0])
        else:
            break
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    pools.forget_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main())
