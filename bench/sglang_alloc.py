"""Benchmark ``sglang_alloc``: SGLang's own slot allocator with and without kvshare.

SGLang's ``TokenToKVPoolAllocator`` over its ``MHATokenToKVPool`` (CPU device), driven as
its scheduler drives it: each step allocates the slots of 8 new requests of 32 tokens and
frees those of 8 requests that finished two steps before. ``plain_slots_per_s`` is SGLang
alone; ``kvshare_slots_per_s`` the same allocator patched by kvshare (its pool on the
``host`` backend, a fixed lease); ``ratio`` = kvshare over plain. On a CPU no copy waits
for a device, so this is the cost of kvshare's bookkeeping on SGLang's allocation path;
that the path never waits for the GPU is pinned by a test
(``tests/engines/sglang/test_no_device_wait.py``).

SGLang runs in its test environment (``make engines``), one process per variant, each
timed in its own interpreter so the patches of one never touch the other.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUESTS, TOKENS = 8, 32
SLOTS = 64 * 1024
PAGE = 2 * 2**20


def measure(variant: str, steps: int) -> float:
    """Slots allocated per second by one variant (runs inside the SGLang environment)."""
    import tempfile

    import torch

    if variant == "kvshare":
        from kvshare.api import env
        from kvshare.runtime.engines.activation import activate

        scratch = tempfile.mkdtemp(prefix="kvs-bench-")
        for variable, value in (
            (env.BACKEND, "host"),
            (env.PAGE_SIZE, str(PAGE)),
            (env.KV_LIMIT, str(2**30)),
            (env.RESERVE_PAGES, "4"),
            (env.BROKER_SOCKET, os.path.join(scratch, "no-broker.sock")),
        ):
            os.environ[variable.name] = value
        activate("sglang")
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kvcache = MHATokenToKVPool(
        SLOTS,
        page_size=1,
        dtype=torch.float16,
        head_num=2,
        head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(SLOTS, torch.float16, "cpu", kvcache, need_sort=False)
    running: list[torch.Tensor] = []

    def step() -> None:
        for _ in range(REQUESTS):
            slots = allocator.alloc(TOKENS)
            assert slots is not None, "the allocator ran out"
            running.append(slots)
        while len(running) > 2 * REQUESTS:
            allocator.free(running.pop(0))

    for _ in range(50):  # warm up: the pool maps its first pages
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * REQUESTS * TOKENS / (time.perf_counter() - start)


def _environment() -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    from tools import engine_env

    from kvshare.api.engines import SUPPORTED

    line = next(line for line in SUPPORTED if line.engine == "sglang")
    if not engine_env.is_built(line):
        raise RuntimeError(f"{line.environment} is not installed: run `make engines`")
    paths = [str(path) for path in engine_env.python_path(line)] + [str(ROOT / "src")]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "kvs-bench-sglang"
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "SGLANG_CACHE_DIR": str(scratch),
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }


def _run_variant(variant: str, steps: int, environ: dict[str, str]) -> float:
    done = subprocess.run(
        [sys.executable, "-P", __file__, "--measure", variant, str(steps)],  # -P: no bench/ first
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {variant} run failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def run(quick: bool) -> object:
    from harness import Result, Target

    steps, rounds = (300, 1) if quick else (2000, 7)
    environ = _environment()
    plain: list[float] = []
    pooled: list[float] = []
    for _ in range(rounds):  # alternated, so drift hits both alike
        plain.append(_run_variant("plain", steps, environ))
        pooled.append(_run_variant("kvshare", steps, environ))
    plain_s, pooled_s = statistics.median(plain), statistics.median(pooled)
    # Each round's own ratio: how far one pair of runs strays on a shared machine.
    ratios = [k / p for p, k in zip(plain, pooled, strict=True)]
    return Result(
        name="sglang_alloc",
        fields={
            "plain_slots_per_s": round(plain_s),
            "kvshare_slots_per_s": round(pooled_s),
            "ratio": round(pooled_s / plain_s, 3),
            "rounds": rounds,
            "round_ratio_min": round(min(ratios), 3),
            "round_ratio_max": round(max(ratios), 3),
            "load_average": round(os.getloadavg()[0], 2),
        },
        targets=[Target("ratio", ">=", 0.8)],
        notes=(
            f"SGLang's TokenToKVPoolAllocator on the CPU device ({SLOTS} slots), {REQUESTS} "
            f"requests of {TOKENS} tokens allocated and freed per step; kvshare on the host "
            "backend. Plain SGLang's alloc is a slice of its free list and its free one "
            "concatenation; kvshare adds, per call, the pool's books (the blocks taken from "
            "and returned to their pages) and the conversion of ids between the tensor and "
            "the pool: a few microseconds of CPU, paid on the scheduler's thread, never a wait "
            "for the device."
        ),
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--measure"]:
    print(json.dumps(measure(sys.argv[2], int(sys.argv[3]))))
