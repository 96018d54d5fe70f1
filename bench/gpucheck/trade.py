"""Step ``trade``: the node agent's broker and two worker processes on the GPU: one fills
the GPU's budget, the other asks for memory, the first frees its blocks, and the second
must then map what the first gave back (and the device's free memory must show it)."""

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

#: The entry point the worker processes run (``--trade-worker``).
ENTRY = ROOT / "bench" / "gpu_check.py"

#: Budget of the broker's GPU for the trade (the fake inventory's size).
TRADE_BUDGET = GIB


def trade_worker(backend_kind: str) -> int:
    """A worker of the trade step: a pool leased by the broker, driven by stdin commands.

    Commands (one JSON object a line): ``{"fill": at_least_bytes, "within_s": s}`` takes
    blocks until the pool holds at least that much and stops growing, then writes and
    reads back a pattern in them; ``{"free": true}`` frees every block; ``{"exit": true}``.
    Each answer is the pool's snapshot (one JSON line).
    """
    import torch

    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.leases import lease_from_env
    from kvshare.runtime.pool import KVPool

    backend = open_backend(backend_kind, 0)  # type: ignore[arg-type]
    page = max(backend.granularity, 2 * MIB)
    geometry = KVGeometry(num_buffers=2, block_bytes=page // 8, num_blocks=8 * 2048, page_size=page)
    pool = KVPool(geometry, backend, lease_from_env(), lease_chunk_bytes=8 * page)
    blocks: list[int] = []
    out = sys.stdout
    try:
        for line in sys.stdin:
            command = json.loads(line)
            verified = None
            if "fill" in command:
                blocks += _fill(pool, int(command["fill"]), float(command["within_s"]))
                verified = _write_and_check(pool, blocks, torch)
            elif "free" in command:
                pool.free(blocks)
                blocks = []
                pool.maintain()
            elif "snapshot" in command:
                pool.maintain()
            elif "exit" in command:
                break
            snap = pool.snapshot()
            out.write(
                json.dumps(
                    {
                        "held": snap.held,
                        "lease": snap.lease,
                        "blocks": len(blocks),
                        "verified": verified,
                    }
                )
                + "\n"
            )
            out.flush()
    finally:
        pool.close()
    return 0


def _fill(pool: Any, at_least: int, within_s: float) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + within_s
    last_progress = time.monotonic()
    while time.monotonic() < deadline:
        ids = pool.alloc(8)
        if isinstance(ids, list):
            got += ids
            last_progress = time.monotonic()
            continue
        if pool.snapshot().held >= at_least and time.monotonic() - last_progress > 1.0:
            break
        time.sleep(0.02)
    return got


def _write_and_check(pool: Any, blocks: list[int], torch: Any) -> bool:
    """Fill every block with a pattern of its id and read the pattern back.

    The read-back compares a few bytes of each block, so it allocates little; torch's
    cached device memory is given back after, so the device's free memory shows only the
    pools.
    """
    if not blocks:
        return False
    view = pool.tensor(0)[0]
    index = torch.tensor(blocks, device=view.device)
    pattern = (index % 251).to(torch.uint8)
    view[index] = pattern.unsqueeze(1).expand(-1, view.shape[1])
    ok = bool(torch.equal(view[index, :: view.shape[1] // 4], pattern.unsqueeze(1).expand(-1, 4)))
    del index, pattern
    if view.device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def trade_memory(setup: Setup) -> dict[str, Any]:
    """The trade step; its logs are kept (and named) only when it fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvs-gpu-", dir="/tmp"))
    try:
        result = _trade(setup, run_dir)
    except Exception as exc:
        raise RuntimeError(f"{exc} (logs in {run_dir})") from exc
    if result["ok"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        result["logs"] = str(run_dir)
    return result


def _trade(setup: Setup, run_dir: Path) -> dict[str, Any]:
    from kvshare.demo.node_agent import NodeAgent, pick_metrics_port

    port, _ = pick_metrics_port(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    node = NodeAgent.start(run_dir, TRADE_BUDGET, port, env)
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        node.wait_ready(time.monotonic() + 60)
        for name in ("a", "b"):
            pool_env = node.pool_env(f"gpu-check-{name}", kv_max=TRADE_BUDGET)
            with (run_dir / f"worker-{name}.log").open("w") as log_file:
                workers[name] = subprocess.Popen(
                    [sys.executable, str(ENTRY), "--trade-worker", setup.backend],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    text=True,
                    env={**env, **pool_env},
                )

        def ask(name: str, command: dict[str, Any]) -> dict[str, Any]:
            proc = workers[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {name} exited")
            answer: dict[str, Any] = json.loads(line)
            return answer

        began = time.monotonic()
        a_full = ask("a", {"fill": TRADE_BUDGET // 2, "within_s": 30})
        a_fill_s = time.monotonic() - began
        free_full = setup.device_free()
        # b asks while a holds the budget; a then frees its blocks and the broker moves
        # the memory over.
        b_proc = workers["b"]
        assert b_proc.stdin is not None and b_proc.stdout is not None
        b_proc.stdin.write(json.dumps({"fill": TRADE_BUDGET // 4, "within_s": 45}) + "\n")
        b_proc.stdin.flush()
        time.sleep(1.0)
        freed_at = time.monotonic()
        a_after = ask("a", {"free": True})
        b_line = b_proc.stdout.readline()
        if not b_line:
            raise RuntimeError("worker b exited")
        b_full = json.loads(b_line)
        trade_s = time.monotonic() - freed_at
        a_end = ask("a", {"snapshot": True})
        free_end = setup.device_free()
        result: dict[str, Any] = {
            "budget_bytes": TRADE_BUDGET,
            "a_held_bytes": a_full["held"],
            "a_after_free_bytes": a_after["held"],
            "a_at_end_bytes": a_end["held"],
            "b_held_bytes": b_full["held"],
            "b_blocks_verified": b_full["verified"],
            "a_fill_s": round(a_fill_s, 2),
            "trade_s": round(trade_s, 2),
        }
        ok = (
            a_full["held"] >= TRADE_BUDGET // 2
            and b_full["held"] >= TRADE_BUDGET // 4
            and b_full["verified"] is True
            and a_full["held"] - a_end["held"] >= b_full["held"] // 2
            and a_end["held"] + b_full["held"] <= TRADE_BUDGET
        )
        if free_full is not None and free_end is not None:
            result["device_free_change_bytes"] = free_end - free_full
            # What b mapped came out of what a gave back: the device is no fuller (up to
            # a few pages of allocator noise).
            ok = ok and free_end - free_full >= -(32 * MIB)
        result["ok"] = ok
        return result
    finally:
        for proc in workers.values():
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=20)
        node.stop()
