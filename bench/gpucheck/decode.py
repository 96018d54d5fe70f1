"""Step ``decode``: a small random-weight decoder with its KV cache in a pool and in plain
tensors (GQA attention over a paged KV cache, no weights downloaded); ``ratio`` = pool
tokens/s over plain tokens/s."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpucheck.machine import MIB, Setup


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
