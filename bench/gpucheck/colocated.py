"""Step ``colocated_start``: two engine-like workers start on one GPU together, through the
broker, and both get through.

Each worker process does what a patched vLLM worker does at start-up: it takes its GPU's
start-up turn, loads its "weights" (device memory of its static footprint), checks the
device's free memory against what kvshare grants it (static footprint + KV minimum, as the
patched ``request_memory`` does) instead of 92 % of the device, opens its pool and maps its
minimum, then ends its turn. The weights are a tenth of the device each, so the second
worker starts with less free memory than plain vLLM would accept. In a dry run the device
is host memory and the weights are small.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpucheck.machine import GIB, MIB, ROOT, Setup

ENTRY = ROOT / "bench" / "gpu_check.py"
#: vLLM's default share of the device its start-up check asks for.
VLLM_UTILIZATION = 0.92
KV_MIN = 64 * MIB


def _device_memory(backend_kind: str) -> tuple[int, int]:
    """(free, total) of the device the worker starts on."""
    if backend_kind == "host":
        from kvshare.runtime.backends.host import HostBackend

        with contextlib.closing(HostBackend()) as host:
            free = host.free_memory()
        return free, free
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return int(free), int(total)


def start_worker(backend_kind: str) -> int:
    """One worker: start as described above, print one JSON line, hold until stdin closes."""
    import torch

    from kvshare.runtime.engines import pools
    from kvshare.runtime.engines.pools import Role
    from kvshare.runtime.geometry import KVGeometry

    device = "cpu" if backend_kind == "host" else "cuda:0"
    began = time.monotonic()
    with pools.startup_turn(Role("vllm", 0, 1, "coordinated")):
        turn_wait_s = time.monotonic() - began
        static = int(os.environ["KVSHARE_STATIC_BYTES"])
        weights = torch.empty(static, dtype=torch.uint8, device=device)
        free, total = _device_memory(backend_kind)
        budget = pools.startup_budget()
        page = pools.page_size()
        geometry = KVGeometry(
            num_buffers=2, block_bytes=page // 8, num_blocks=8 * 64, page_size=page
        )
        pool = pools.open_local_pool(geometry, device, Role("vllm", 0, 1, "local"))
        held = pool.alloc(2 * len(geometry.blocks_of(1)))  # a few pages, within its minimum
    result = {
        "turn_wait_s": round(turn_wait_s, 2),
        "free_at_check": free,
        "grant": budget,
        "passes_kvshare_check": free >= budget,
        "plain_vllm_refuses": free < VLLM_UTILIZATION * total,
        "kv_blocks": len(held) if isinstance(held, list) else 0,
        "refused": "" if isinstance(held, list) else held.reason,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # hold the memory until the check is done
    del weights
    pools.forget_pools()
    return 0


def colocated_start(setup: Setup) -> dict[str, Any]:
    from kvshare.demo.node_agent import NodeAgent, pick_metrics_port

    _, total = _device_memory(setup.backend)
    static = 64 * MIB if setup.dry_run else total // 10
    run_dir = Path(tempfile.mkdtemp(prefix="kvs-gpu-start-", dir="/tmp"))
    port, _ = pick_metrics_port(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    node = NodeAgent.start(run_dir, 3 * static + GIB, port, env)
    workers: list[subprocess.Popen[str]] = []
    try:
        node.wait_ready(time.monotonic() + 60)
        for name in ("a", "b"):
            worker_env = {
                **env,
                **node.pool_env(f"gpu-check-start-{name}", kv_max=static, kv_min=KV_MIN),
                "KVSHARE_STATIC_BYTES": str(static),
                "KVSHARE_BACKEND": setup.backend,
                "KVSHARE_RESERVE_PAGES": "0",
            }
            with (run_dir / f"start-{name}.log").open("w") as log_file:
                workers.append(
                    subprocess.Popen(
                        [sys.executable, str(ENTRY), "--start-worker", setup.backend],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log_file,
                        text=True,
                        env=worker_env,
                    )
                )
        began = time.monotonic()
        answers = []
        for worker in workers:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited (logs in {run_dir})")
            answers.append(json.loads(line))
        both_s = time.monotonic() - began
        second = max(answers, key=lambda answer: answer["turn_wait_s"])
        result: dict[str, Any] = {
            "static_bytes": static,
            "both_started_s": round(both_s, 2),
            "second_turn_wait_s": second["turn_wait_s"],
            "second_free_at_check": second["free_at_check"],
            "second_grant": second["grant"],
            "plain_vllm_refuses_second": second["plain_vllm_refuses"],
            "kv_blocks": [answer["kv_blocks"] for answer in answers],
            "refused": [answer["refused"] for answer in answers if answer["refused"]],
            "ok": all(a["passes_kvshare_check"] and a["kv_blocks"] > 0 for a in answers)
            and both_s < 120,
        }
        if not setup.dry_run:
            # The point of the check: a start that plain vLLM refuses gets through.
            result["ok"] = result["ok"] and second["plain_vllm_refuses"]
        return result
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                assert worker.stdin is not None
                worker.stdin.close()
                worker.wait(timeout=30)
        node.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
