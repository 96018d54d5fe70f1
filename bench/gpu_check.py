"""``make gpu-check``: what only a machine with an NVIDIA GPU can tell about kvshare.

Needs an NVIDIA GPU with its driver, PyTorch built for CUDA and cuda-python; no engines,
no model downloads, no network. Four steps, one JSON summary printed last:

1. ``gpu_tests`` — the ``gpu``-marked tests (``pytest -m gpu``), run for real.
2. ``page_ops`` — the ``cuda`` backend's page create / map (with set-access) / unmap /
   release, against the bare driver calls (``cuMemCreate``, ``cuMemMap``,
   ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``) in the same run.
3. ``decode`` — a small random-weight decoder (GQA attention over a paged KV cache, no
   weights downloaded) decodes a batch with its KV cache in a kvshare pool and in plain
   tensors; ``ratio`` = pool tokens/s over plain tokens/s.
4. ``trade`` — the node agent's broker and two worker processes on the GPU: one fills
   the GPU's budget, the other asks for memory, the first frees its blocks, and the second
   must then map what the first gave back (and the device's free memory must show it).

``--write BENCHMARKS.md`` records the results in the report's GPU section, which
``make bench`` keeps. ``--dry-run`` runs every step on a machine without a GPU — the
``host`` backend instead of ``cuda``, libc calls instead of the driver's, the decoder on
the CPU — so the check itself is known to work before GPU time is spent on it. Without
``--dry-run`` on a machine without a GPU it stops at once with status 3 and says so.
Exit status: 0 all steps passed, 1 a step failed, 3 no GPU, 4 a package is missing (the
node agent's generated kubelet API stubs are made first if grpcio-tools is there).
"""

from __future__ import annotations

import os
import sys

# `python bench/gpu_check.py` puts bench/ first on sys.path, where bench/operator.py would
# shadow Python's own `operator` module: bench/ goes last.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import argparse
import contextlib
import ctypes
import importlib.util
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

EXIT_FAILED = 1
EXIT_NO_GPU = 3
EXIT_MISSING = 4
MIB = 2**20
GIB = 2**30


# --- what machine is this ------------------------------------------------------------


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check on a GPU, or None when it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    try:
        import torch
    except ImportError:
        return None  # the driver is there; the missing package is reported next
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


def missing_packages(dry_run: bool) -> list[str]:
    """Python distributions the check needs that are not importable."""
    needed = {"torch": "torch", "numpy": "numpy", "pytest": "pytest"}
    needed |= {"prometheus_client": "prometheus-client", "grpc": "grpcio"}
    needed |= {"pydantic": "pydantic", "yaml": "pyyaml"}
    if not dry_run:
        needed |= {"cuda.bindings": "cuda-python", "pynvml": "nvidia-ml-py"}
    missing = []
    for module, dist in needed.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(dist)
    if not ensure_kubelet_stubs():
        missing.append("grpcio-tools (or copy the stubs `make proto` writes)")
    return missing


def ensure_kubelet_stubs() -> bool:
    """Whether the node agent's generated kubelet API stubs are there (made if they can be)."""
    stubs = ROOT / "src" / "kvshare" / "deviceplugin" / "v1beta1" / "api_pb2.py"
    if stubs.exists():
        return True
    if importlib.util.find_spec("grpc_tools") is None:
        return False
    from kvshare.deviceplugin.protogen import generate

    generate()
    return stubs.exists()


@dataclass(frozen=True)
class Setup:
    """Where the steps run: the ``cuda`` backend on GPU 0, or ``host`` in a dry run."""

    dry_run: bool

    @property
    def backend(self) -> str:
        return "host" if self.dry_run else "cuda"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.dry_run else "cuda:0"

    def describe(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {
            "mode": "dry-run" if self.dry_run else "gpu",
            "backend": self.backend,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        if not self.dry_run:
            props = torch.cuda.get_device_properties(0)
            info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / GIB, 1)}
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlInit()
                info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        return info

    def synchronize(self) -> None:
        if not self.dry_run:
            import torch

            torch.cuda.synchronize()

    def device_free(self) -> int | None:
        """Free memory of the device, or None in a dry run (host memory is too noisy)."""
        if self.dry_run:
            return None
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        return int(free)


# --- step 1: the gpu-marked tests ----------------------------------------------------


def gpu_test_files() -> list[str]:
    """Test files that hold ``gpu``-marked tests (collecting only these keeps the check
    independent of the packages other tests need)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "mark.gpu" in text:
            files.append(str(path.relative_to(ROOT)))
    return files


def run_gpu_tests(setup: Setup) -> dict[str, Any]:
    files = gpu_test_files()
    if not files:
        return {"files": 0, "passed": 0, "failed": 0, "skipped": 0, "ok": True}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"),
                f"--junitxml={report}",
                *files,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.exists():
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, "0"))
    failed = counts["failures"] + counts["errors"]
    result: dict[str, Any] = {
        "files": len(files),
        "passed": counts["tests"] - failed - counts["skipped"],
        "failed": failed,
        "skipped": counts["skipped"],
        "ok": done.returncode in (0, 5) and failed == 0,  # 5: every test deselected
    }
    if not result["ok"]:
        result["output_tail"] = (done.stdout + done.stderr)[-3000:]
    if not setup.dry_run and result["passed"] == 0:
        result["ok"] = False
        result["why"] = "no gpu test ran on a GPU machine"
    return result


# --- step 2: page operations, backend against bare calls -----------------------------


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 2)


def _timed(fn: Callable[[], Any], out: list[float]) -> Any:
    start = time.perf_counter()
    value = fn()
    out.append(time.perf_counter() - start)
    return value


def backend_page_ops(setup: Setup, pages: int) -> tuple[int, dict[str, float]]:
    """Median µs per page of the kvshare backend's create, map, unmap and release."""
    from kvshare.runtime.backends import open_backend

    backend = open_backend(setup.backend, 0)  # type: ignore[arg-type]
    size = max(backend.granularity, 2 * MIB)
    times: dict[str, list[float]] = {"create": [], "map": [], "unmap": [], "release": []}
    try:
        base = backend.reserve(pages * size)
        handles = [_timed(lambda: backend.create(size), times["create"]) for _ in range(pages)]
        for i, handle in enumerate(handles):
            _timed(lambda i=i, h=handle: backend.map(base + i * size, size, h), times["map"])
        for i in range(pages):
            _timed(lambda i=i: backend.unmap(base + i * size, size), times["unmap"])
        for handle in handles:
            _timed(lambda h=handle: backend.release(h), times["release"])
        backend.free_reservation(base)
    finally:
        backend.close()
    return size, {op: _median_us(samples) for op, samples in times.items()}


def _bare_times() -> dict[str, list[float]]:
    """Samples per bare call, by operation."""
    return {op: [] for op in ("create", "map", "set_access", "unmap", "release")}


def bare_cuda_page_ops(size: int, pages: int) -> dict[str, float]:
    """Median µs per page of the driver's own calls (cuda-python, no kvshare code)."""
    from cuda.bindings import driver as cu

    def check(result: Any) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return result[1] if isinstance(result, tuple) and len(result) == 2 else result

    check(cu.cuInit(0))
    device = check(cu.cuDeviceGet(0))
    context = check(cu.cuDevicePrimaryCtxRetain(device))
    check(cu.cuCtxSetCurrent(context))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    times = _bare_times()
    base = int(check(cu.cuMemAddressReserve(pages * size, 0, 0, 0)))
    try:
        handles = [
            _timed(lambda: check(cu.cuMemCreate(size, prop, 0)), times["create"])
            for _ in range(pages)
        ]
        for i, handle in enumerate(handles):
            ptr = cu.CUdeviceptr(base + i * size)
            _timed(lambda p=ptr, h=handle: check(cu.cuMemMap(p, size, 0, h, 0)), times["map"])
            _timed(
                lambda p=ptr: check(cu.cuMemSetAccess(p, size, [access], 1)),
                times["set_access"],
            )
        for i in range(pages):
            ptr = cu.CUdeviceptr(base + i * size)
            _timed(lambda p=ptr: check(cu.cuMemUnmap(p, size)), times["unmap"])
        for handle in handles:
            _timed(lambda h=handle: check(cu.cuMemRelease(h)), times["release"])
    finally:
        check(cu.cuMemAddressFree(cu.CUdeviceptr(base), pages * size))
    return {op: _median_us(samples) for op, samples in times.items()}


def bare_host_page_ops(size: int, pages: int) -> dict[str, float]:
    """The host analogue of the driver calls, straight from libc (dry run)."""
    from kvshare.runtime.backends import libc

    times = _bare_times()
    fd = os.memfd_create("kvshare-gpu-check")
    try:
        os.ftruncate(fd, pages * size)
        flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
        base = libc.mmap(0, pages * size, libc.PROT_NONE, flags)
        try:
            for i in range(pages):
                _timed(lambda i=i: libc.fallocate(fd, 0, i * size, size), times["create"])
            for i in range(pages):
                _timed(
                    lambda i=i: libc.map_shared_fixed(base + i * size, size, fd, i * size),
                    times["map"],
                )
                times["set_access"].append(0.0)  # part of mmap's protection on the host
            for i in range(pages):
                _timed(lambda i=i: libc.protect_none_fixed(base + i * size, size), times["unmap"])
            punch = libc.FALLOC_FL_PUNCH_HOLE | libc.FALLOC_FL_KEEP_SIZE
            for i in range(pages):
                _timed(lambda i=i: libc.fallocate(fd, punch, i * size, size), times["release"])
        finally:
            libc.munmap(base, pages * size)
    finally:
        os.close(fd)
    return {op: _median_us(samples) for op, samples in times.items()}


def measure_page_ops(setup: Setup) -> dict[str, Any]:
    pages = 64
    size, ours = backend_page_ops(setup, pages)
    bare = bare_host_page_ops(size, pages) if setup.dry_run else bare_cuda_page_ops(size, pages)
    bare_map = bare["map"] + bare["set_access"]
    result: dict[str, Any] = {"page_bytes": size, "pages": pages}
    for op in ("create", "unmap", "release"):
        result[f"{op}_us"] = ours[op]
        result[f"bare_{op}_us"] = bare[op]
    result["map_us"] = ours["map"]
    result["bare_map_us"] = bare["map"]
    result["bare_set_access_us"] = bare["set_access"]
    result["map_overhead_ratio"] = round(ours["map"] / bare_map, 3) if bare_map else None
    result["create_overhead_ratio"] = round(ours["create"] / bare["create"], 3)
    result["ok"] = True
    return result


# --- step 3: decode with the KV cache in a pool --------------------------------------


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    prompt: int
    steps: int
    block: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def blocks_per_seq(self) -> int:
        return -(-(self.prompt + self.steps) // self.block)


GPU_DECODER = DecoderShape(
    layers=8, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000, batch=32, prompt=1024,
    steps=128,
)  # fmt: skip
DRY_DECODER = DecoderShape(
    layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=1000, batch=4, prompt=64, steps=16
)


def build_decoder(shape: DecoderShape, device: str, dtype: Any) -> Any:
    """A random-weight decoder with GQA attention over a paged KV cache."""
    import torch
    from torch import nn
    from torch.nn import functional

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hd = shape.head_dim
            self.norm1 = nn.RMSNorm(shape.hidden)
            self.qkv = nn.Linear(shape.hidden, (shape.heads + 2 * shape.kv_heads) * hd, bias=False)
            self.out = nn.Linear(shape.heads * hd, shape.hidden, bias=False)
            self.norm2 = nn.RMSNorm(shape.hidden)
            self.gate_up = nn.Linear(shape.hidden, 2 * shape.ffn, bias=False)
            self.down = nn.Linear(shape.ffn, shape.hidden, bias=False)

        def forward(self, x: Any, cache: Any, table: Any, pos: int) -> Any:
            b, hd, kvh = x.shape[0], shape.head_dim, shape.kv_heads
            q, k, v = self.qkv(self.norm1(x)).split([shape.heads * hd, kvh * hd, kvh * hd], dim=-1)
            rows = torch.arange(b, device=x.device)
            slot_block = table[rows, pos // shape.block]
            cache[0][slot_block, pos % shape.block] = k.view(b, kvh, hd)
            cache[1][slot_block, pos % shape.block] = v.view(b, kvh, hd)
            used = pos // shape.block + 1
            ids = table[:, :used]
            keys = cache[0][ids].reshape(b, used * shape.block, kvh, hd)[:, : pos + 1]
            values = cache[1][ids].reshape(b, used * shape.block, kvh, hd)[:, : pos + 1]
            group = shape.heads // kvh
            keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)
            values = values.transpose(1, 2).repeat_interleave(group, dim=1)
            attn = functional.scaled_dot_product_attention(
                q.view(b, shape.heads, 1, hd), keys, values
            )
            x = x + self.out(attn.reshape(b, shape.heads * hd))
            gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(functional.silu(gate) * up)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(shape.vocab, shape.hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(shape.layers))
            self.norm = nn.RMSNorm(shape.hidden)
            self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

        @torch.inference_mode()
        def step(self, tokens: Any, caches: list[Any], table: Any, pos: int) -> Any:
            x = self.embed(tokens)
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, cache, table, pos)
            return self.head(self.norm(x)).argmax(dim=-1)

    torch.manual_seed(0)
    return Decoder().to(device=device, dtype=dtype).eval()


@contextlib.contextmanager
def pool_caches(setup: Setup, shape: DecoderShape, dtype: Any) -> Iterator[tuple[list[Any], Any]]:
    """Per-layer (K, V) caches in a kvshare pool, and the block table of the batch."""
    import torch

    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.lease import StaticLease
    from kvshare.runtime.pool import KVPool

    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = shape.block * shape.kv_heads * shape.head_dim * elem
    blocks = shape.batch * shape.blocks_per_seq
    backend = open_backend(setup.backend, 0)  # type: ignore[arg-type]
    page = max(backend.granularity, 2 * MIB)
    geometry = KVGeometry(
        num_buffers=2 * shape.layers,
        block_bytes=block_bytes,
        num_blocks=blocks + page // block_bytes + 1,
        page_size=page,
    )
    lease = StaticLease(geometry.num_buffers * (geometry.num_pages + 1) * page)
    pool = KVPool(geometry, backend, lease)
    try:
        ids = pool.alloc(blocks)
        if not isinstance(ids, list):
            raise RuntimeError(f"the pool could not hold the decoder's KV cache: {ids}")
        caches = []
        for layer in range(shape.layers):
            raw = pool.tensor(2 * layer, 2).view(dtype)
            caches.append(
                raw.view(2, geometry.num_blocks, shape.block, shape.kv_heads, shape.head_dim)
            )
        table = torch.tensor(ids, device=setup.torch_device).view(shape.batch, -1)
        yield caches, table
    finally:
        pool.close()


def plain_caches(setup: Setup, shape: DecoderShape, dtype: Any, num_blocks: int) -> list[Any]:
    import torch

    size = (2, num_blocks, shape.block, shape.kv_heads, shape.head_dim)
    return [torch.zeros(size, dtype=dtype, device=setup.torch_device) for _ in range(shape.layers)]


def decode_tokens_per_s(
    setup: Setup, model: Any, shape: DecoderShape, caches: Any, table: Any
) -> float:
    import torch

    torch.manual_seed(1)
    for cache in caches:  # the prompt's keys and values: random, as if prefilled
        ids = table[:, : -(-shape.prompt // shape.block)].reshape(-1)
        cache[:, ids] = torch.randn_like(cache[:, ids])
    tokens = torch.randint(0, shape.vocab, (shape.batch,), device=setup.torch_device)
    for pos in range(shape.prompt, shape.prompt + 4):  # warm-up
        tokens = model.step(tokens, caches, table, pos)
    setup.synchronize()
    start = time.perf_counter()
    for pos in range(shape.prompt, shape.prompt + shape.steps):
        tokens = model.step(tokens, caches, table, pos)
    setup.synchronize()
    return shape.batch * shape.steps / (time.perf_counter() - start)


def measure_decode(setup: Setup) -> dict[str, Any]:
    import torch

    shape = DRY_DECODER if setup.dry_run else GPU_DECODER
    dtype = torch.float32 if setup.dry_run else torch.bfloat16
    model = build_decoder(shape, setup.torch_device, dtype)
    pool_runs: list[float] = []
    plain_runs: list[float] = []
    with pool_caches(setup, shape, dtype) as (caches, table):
        plain = plain_caches(setup, shape, dtype, caches[0].shape[1])
        for _ in range(3):  # interleaved, so drift hits both alike
            plain_runs.append(decode_tokens_per_s(setup, model, shape, plain, table))
            pool_runs.append(decode_tokens_per_s(setup, model, shape, caches, table))
    pool_tps, plain_tps = statistics.median(pool_runs), statistics.median(plain_runs)
    return {
        "shape": f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads}"
        f" heads, batch {shape.batch}, context {shape.prompt}+{shape.steps}",
        "pool_tokens_per_s": round(pool_tps, 1),
        "plain_tokens_per_s": round(plain_tps, 1),
        "ratio": round(pool_tps / plain_tps, 3),
        "ok": pool_tps / plain_tps >= 0.9 or setup.dry_run,
    }


# --- step 4: two processes trade memory through the broker ---------------------------

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
    from kvshare.demo.orchestrator import NodeAgent, pick_metrics_port

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
                    [sys.executable, __file__, "--trade-worker", setup.backend],
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


# --- the summary ---------------------------------------------------------------------

STEPS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "gpu_tests": run_gpu_tests,
    "page_ops": measure_page_ops,
    "decode": measure_decode,
    "trade": trade_memory,
}


def run_steps(setup: Setup, skip: set[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"check": "kvshare gpu-check", **setup.describe()}
    began = time.monotonic()
    for name, step in STEPS.items():
        if name in skip:
            summary[name] = {"skipped": True, "ok": True}
            continue
        start = time.monotonic()
        try:
            summary[name] = step(setup)
        except Exception as exc:
            summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        summary[name]["seconds"] = round(time.monotonic() - start, 1)
    summary["wall_s"] = round(time.monotonic() - began, 1)
    summary["ok"] = all(summary[name].get("ok") for name in STEPS)
    return summary


def gpu_section(summary: dict[str, Any], date: str, command: str) -> str:
    """The BENCHMARKS.md section of one run."""
    title = "GPU check" + (
        " (dry run: host backend, no GPU)" if summary["mode"] == "dry-run" else ""
    )
    machine = summary.get("gpu", "no GPU") + (
        f", driver {summary['driver']}" if "driver" in summary else ""
    )
    lines = [
        f"## {title}",
        "",
        f"Machine: {machine}; PyTorch {summary['torch']}, Python {summary['python']}. "
        f"Date: {date}. Command: `{command}`. Wall time {summary['wall_s']} s. "
        f"All steps passed: {'yes' if summary['ok'] else '**no**'}.",
        "",
        "| step | field | measured |",
        "|---|---|---|",
    ]
    for step in STEPS:
        for key, value in summary.get(step, {}).items():
            if key in ("output_tail",):
                continue
            lines.append(f"| {step} | `{key}` | {value} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, CPU")
    parser.add_argument("--write", metavar="FILE", help="record the results in FILE's GPU section")
    parser.add_argument(
        "--skip", action="append", default=[], choices=sorted(STEPS), help="leave a step out"
    )
    parser.add_argument("--trade-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trade_worker:
        return trade_worker(args.trade_worker)
    if not args.dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            print(
                f"gpu-check: no GPU on this machine: {reason}. It needs an NVIDIA GPU with its "
                "driver and a CUDA build of PyTorch; `bench/gpu_check.py --dry-run` runs the "
                "same steps without one.",
                file=sys.stderr,
            )
            return EXIT_NO_GPU
    missing = missing_packages(args.dry_run)
    if missing:
        print(
            f"gpu-check: missing Python packages: {', '.join(missing)}; install them into "
            f"this interpreter ({sys.executable} -m pip install {' '.join(missing)}).",
            file=sys.stderr,
        )
        return EXIT_MISSING
    summary = run_steps(Setup(args.dry_run), set(args.skip))
    if args.write:
        from harness import today
        from report import write_gpu_section

        command = "make gpu-check" if not args.dry_run else "python bench/gpu_check.py --dry-run"
        write_gpu_section(Path(args.write), gpu_section(summary, today(), command))
    print(json.dumps(summary))
    return 0 if summary["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
