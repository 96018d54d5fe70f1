"""Tabulate the GPU twin's data from NVIDIA's AIConfigurator (``aiconfigurator-core``).

    PYTHONPATH=src .venv/bin/python tools/tabulate_steps.py [--only GPU] [--check N]

Writes, under ``src/kvshare/twin/data/``:

- ``gpus.json``: every GPU kind the twin knows, from AIConfigurator's
  ``systems/<gpu>.yaml`` (memory, bandwidth, dense bf16 compute, what it sets aside per
  process for NCCL and for CUDA/cuBLAS);
- ``architectures.json``: every architecture's Hugging Face config fields the twin needs
  (layers, heads, KV heads, head size, sizes, vocabulary, dtype), from AIConfigurator's
  ``model_configs/``;
- ``steps/<gpu>/<architecture>--<engine>--tp<k>.json``: the step-time tables of one
  (GPU, architecture, engine, tensor-parallel size), and the memory the engine keeps
  beside its weights.

AIConfigurator prices a mixed prefill/decode step as the sum of three passes
(``EngineHandle.mixed_step_breakdown``): the non-attention ops (GEMMs, norms, all-reduce)
over every token of the step, the prefill's attention, and the decode attention. The
first depends only on the step's tokens, the second on the prefill tokens and the length
of the prompt they belong to, the third on the decoding requests and the context they
attend to. So the tables are one per pass, on the axes it depends on, and a step costs the
sum of the three looked up (:mod:`kvshare.twin.steps`). Each file records its grid, the
package version, the perf-data folder the numbers come from, the measured/estimated source
of each op AIConfigurator reports, and the interpolation error: the tables against
AIConfigurator's own ``mixed_step_latency`` at random points off the grid.

``--check N`` recomputes N random grid points of every committed table and reports the
largest relative difference (the tests do the same for a few points).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import random
import statistics
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "kvshare" / "twin" / "data"
PACKAGE = "aiconfigurator-core"
ENGINE = "vllm"

#: The twin's architecture names and AIConfigurator's config names for them.
ARCHITECTURES = {
    "meta-llama/Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B",
    "Qwen/Qwen3-8B": "Qwen/Qwen3-8B",
    "Qwen/Qwen3-1.7B": "Qwen/Qwen3-1.7B",
    "Qwen/Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "meta-llama/Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B",
}
SMALL_AND_8B = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B")
#: (GPU, architectures, tensor-parallel sizes) tabulated.
COMBINATIONS: tuple[tuple[str, tuple[str, ...], tuple[int, ...]], ...] = (
    ("h200_sxm", SMALL_AND_8B, (1,)),
    ("h200_sxm", ("meta-llama/Llama-3.1-70B",), (1, 2, 4, 8)),
    ("h100_sxm", SMALL_AND_8B, (1,)),
    ("h100_sxm", ("meta-llama/Llama-3.1-70B",), (2, 4, 8)),
    ("b200_sxm", SMALL_AND_8B, (1,)),
    ("b200_sxm", ("meta-llama/Llama-3.1-70B",), (1, 2, 4, 8)),
    ("a100_sxm", SMALL_AND_8B, (1,)),
    ("l40s", SMALL_AND_8B, (1,)),
)
CONFIG_FIELDS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "torch_dtype",
    "max_position_embeddings",
    "attention_bias",
)

#: Tokens in a step (the non-attention pass). AIConfigurator's GEMM times jump just past
#: every multiple of 256 tokens from 512 to 4352 (one more wave of GEMM tiles: +24 % at
#: 513 tokens for an 8B model on an L40S): the grid holds both sides of each jump.
TOKENS = tuple(
    sorted(
        {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256}
        | {256 * k + d for k in range(1, 18) for d in (0, 1, 128)}
        | {3392, 3456, 3520, 5120, 6144, 7168, 8192, 10240, 12288, 16384, 20480, 24576, 32768}
    )
)
#: Prefill tokens in a step in prompts: below 1 a chunk of one prompt, above 1 several
#: whole prompts (whole prompts lie on the grid's lines, the attention's ridge between a
#: chunk's cost and a batch's); and the length of the prompts they belong to.
PROMPTS = (
    *(2.0**-k for k in range(13, 0, -1)),
    *(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048),
)
LENGTHS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
           6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)  # fmt: skip
#: Decoding requests in a step, and the tokens each has in its KV cache (mean).
#: The measured decode attention jumps between 2^k - 1 and 2^k requests (at 31 -> 32: +33 %
#: for Qwen3-0.6B on an A100 at 20k tokens of context): the grid holds both sides.
REQUESTS = tuple(
    sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024}
           | {1536, 2048} | {2**k - 1 for k in range(3, 11)})
)  # fmt: skip
CONTEXTS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288,
            16384, 24576, 32768, 49152, 65536, 98304, 131072)  # fmt: skip
#: Random off-grid points the interpolation is checked on, per table.
CHECK_POINTS = 1500


def _aic() -> Any:
    """The aiconfigurator_core modules the tool uses (a clear error when it is missing)."""
    try:
        from aiconfigurator_core.sdk import engine, perf_database
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.config_builders import build_model_config
        from aiconfigurator_core.sdk.models import get_model
    except ImportError as missing:
        raise SystemExit(
            f"{PACKAGE} is not installed ({missing}); it is in the dev extra: "
            f".venv/bin/pip install {PACKAGE}==0.12.0"
        ) from None
    return argparse.Namespace(
        engine=engine,
        perf_database=perf_database,
        get_backend=get_backend,
        build_model_config=build_model_config,
        get_model=get_model,
    )


def _package_root() -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).resolve().parent


def slug(architecture: str) -> str:
    """The file-name form of an architecture name."""
    return architecture.replace("/", "--")


def table_path(gpu: str, architecture: str, tp: int, engine: str = ENGINE) -> Path:
    """Where the step table of one combination lives."""
    return DATA / "steps" / gpu / f"{slug(architecture)}--{engine}--tp{tp}.json"


class Pricer:
    """AIConfigurator's three passes of a mixed step, for one combination (milliseconds)."""

    def __init__(self, gpu: str, architecture: str, tp: int) -> None:
        aic = _aic()
        self.handle = aic.engine.EngineHandle.compile(
            ARCHITECTURES[architecture], gpu, ENGINE, tp_size=tp
        )

    def linear(self, tokens: int) -> float:
        """The non-attention ops over ``tokens`` tokens (they depend on no split)."""
        return float(self.handle.mixed_step_breakdown(tokens, 0, max(tokens, 16), 1)[1])

    def prefill_attention(self, tokens: int, length: int) -> float:
        """Attention of ``tokens`` prefill tokens of prompts of ``length`` tokens."""
        return float(self.handle.mixed_step_breakdown(tokens, 0, length, 1)[2])

    def prefill_attention_in_prompts(self, prompts: float, length: int) -> float:
        """The same for ``prompts * length`` tokens (at least one)."""
        return self.prefill_attention(max(1, round(prompts * length)), length)

    def decode_attention(self, requests: int, context: int) -> float:
        """Attention of ``requests`` decoding requests with ``context`` cached tokens each."""
        return float(self.handle.mixed_step_breakdown(0, requests, context, 1)[3])

    def mixed(self, prefill: int, length: int, requests: int, context: int) -> float:
        """AIConfigurator's whole mixed step, decode context set through ``osl`` (the
        decode attention is taken at ``isl + osl // 2``; needs ``context >= length``)."""
        return float(
            self.handle.mixed_step_latency(prefill, requests, length, 2 * (context - length) + 1)
        )

    def sources(self) -> dict[str, str]:
        """Where AIConfigurator took each op of a step from (measured ``silicon`` data,
        an ``empirical`` formula, ``mixed``)."""
        parts = self.handle.mixed_step_breakdown_per_op(512, 32, 512, 1)
        return {entry[0]: entry[3] for part in parts for entry in part}


def envelope(values: Sequence[float]) -> list[float]:
    """The running maximum: a bigger batch never takes less time. AIConfigurator's
    measured data dip here and there as the batch grows (another kernel's tiling wins);
    the tables keep the time of the smaller batch over such a dip."""
    out: list[float] = []
    for value in values:
        out.append(max(value, out[-1]) if out else value)
    return out


def _curve(values: Sequence[int], price: Callable[[int], float]) -> list[float]:
    return [round(v, 6) for v in envelope([price(a) for a in values])]


def _grid(
    values: Sequence[float], other: Sequence[int], price: Callable[[Any, int], float]
) -> list[list[float]]:
    """``price`` on the grid, each column made monotone along ``values`` (the batch)."""
    columns = [envelope([price(a, b) for a in values]) for b in other]
    return [[round(column[i], 6) for column in columns] for i in range(len(values))]


def _raised(pricer: Pricer, payload: dict[str, Any]) -> dict[str, float]:
    """How many grid points the envelope raised above AIConfigurator's value, and by most."""
    fresh: list[tuple[float, float]] = []
    linear = payload["linear"]
    fresh += [(v, pricer.linear(t)) for t, v in zip(linear["tokens"], linear["ms"], strict=True)]
    for kind, price in (
        ("prefill_attention", pricer.prefill_attention_in_prompts),
        ("decode_attention", pricer.decode_attention),
    ):
        part = payload[kind]
        a_axis, b_axis = (key for key in part if key != "ms")
        for a, row in zip(part[a_axis], part["ms"], strict=True):
            fresh += [(v, price(a, b)) for b, v in zip(part[b_axis], row, strict=True)]
    raised = [(kept - raw) / raw for kept, raw in fresh if kept > raw * (1 + 1e-6)]
    return {"points": len(raised), "of": len(fresh), "largest": round(max(raised, default=0.0), 4)}


def memory(gpu: str, architecture: str, tp: int, batched_tokens: int) -> dict[str, Any]:
    """What AIConfigurator's vLLM memory model keeps beside the KV cache on one GPU."""
    aic = _aic()
    config = aic.build_model_config(
        tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1
    )
    model = aic.get_model(ARCHITECTURES[architecture], config, ENGINE)
    version = backend_version(gpu)
    database = aic.perf_database.get_database(gpu, ENGINE, version)
    usage = aic.get_backend(ENGINE)._get_memory_usage(
        model, database, 1, 1, 1, 1, num_tokens=batched_tokens
    )
    gib = 2**30
    return {
        "max_num_batched_tokens": batched_tokens,
        "activation_bytes": round(usage["activations"] * gib),
        "nccl_bytes": round(usage["nccl"] * gib),
        "other_bytes": round(usage["others"] * gib),
        "aic_weight_bytes": round(usage["weights"] * gib),
        "source": f"{PACKAGE} VLLMBackend._get_memory_usage(num_tokens=max_num_batched_tokens)",
    }


def backend_version(gpu: str) -> str:
    """The literal vLLM data version AIConfigurator queries for ``gpu`` ('current' slot)."""
    return str(_aic().perf_database.resolve_query_version(gpu, ENGINE, "current"))


def _error_stats(errors: list[float]) -> dict[str, float]:
    errors = sorted(errors)
    return {
        "points": len(errors),
        "median": round(statistics.median(errors), 5),
        "p95": round(errors[int(0.95 * (len(errors) - 1))], 5),
        "max": round(errors[-1], 5),
    }


def _log_uniform(rng: random.Random, low: float, high: float) -> int:
    return round(low * (high / low) ** rng.random())


def interpolation_error(pricer: Pricer, table: Any, seed: int) -> dict[str, Any]:
    """Relative error of the tables' composed step against AIConfigurator's own
    ``mixed_step_latency`` at random points off the grid (``table`` is a
    :class:`kvshare.twin.steps.StepTable`).

    Two sets of points: steps whose prefill is whole prompts (``P`` a multiple of ``L``)
    or absent, and steps whose prefill is any split of prompts. AIConfigurator prices a
    prefill of ``P`` tokens of ``L``-token prompts as ``ceil(P / L)`` whole prompts, or
    one prompt's attention divided by ``ceil(L / P)`` for a chunk: a staircase in ``P``
    that the tables, interpolating between whole multiples, smooth into attention in
    proportion to the tokens (what the chunks of one prompt cost together). The second
    set's error is mostly that difference."""
    from kvshare.demo.step_cost import StepWork

    rng = random.Random(seed)
    errors: dict[str, list[float]] = {"whole_prompts": [], "any_split": []}
    for number in range(2 * CHECK_POINTS):
        kind = "whole_prompts" if number % 2 else "any_split"
        prefill = 0 if rng.random() < 0.3 else _log_uniform(rng, 1, 16384)
        requests = 0 if prefill and rng.random() < 0.2 else _log_uniform(rng, 1, 1024)
        if not prefill:
            length = 16
        elif kind == "whole_prompts":
            length = _log_uniform(rng, 16, 32768)
            prefill = max(1, round(prefill / length)) * length
        else:
            length = _log_uniform(rng, 16, 32768)
        context = _log_uniform(rng, length, 65536)
        work = StepWork(prefill, prefill * length, requests, requests * context)
        truth = pricer.mixed(prefill, length, requests, context)
        errors[kind].append(abs(table.step_ms(work) - truth) / truth)
    return {
        "against": "EngineHandle.mixed_step_latency",
        **{kind: _error_stats(values) for kind, values in errors.items()},
    }


def tabulate(gpu: str, architecture: str, tp: int) -> dict[str, Any]:
    """The step-table file of one combination."""
    from kvshare.twin.gpus import gpu_kind
    from kvshare.twin.steps import StepTable

    pricer = Pricer(gpu, architecture, tp)
    version = backend_version(gpu)
    payload: dict[str, Any] = {
        "format": "kvshare-twin-steps",
        "version": 1,
        "gpu": gpu,
        "architecture": architecture,
        "engine": ENGINE,
        "tensor_parallel": tp,
        "source": {
            "package": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}",
            "model_config": f"model_configs/{slug(ARCHITECTURES[architecture])}_config.json",
            "perf_data": f"systems/data/{gpu}/<op>/{ENGINE}/{version}",
            "op_sources": pricer.sources(),
        },
        "linear": {"tokens": list(TOKENS), "ms": _curve(TOKENS, pricer.linear)},
        "prefill_attention": {
            "prompts": list(PROMPTS),
            "lengths": list(LENGTHS),
            "ms": _grid(PROMPTS, LENGTHS, pricer.prefill_attention_in_prompts),
        },
        "decode_attention": {
            "requests": list(REQUESTS),
            "contexts": list(CONTEXTS),
            "ms": _grid(REQUESTS, CONTEXTS, pricer.decode_attention),
        },
        "memory": memory(gpu, architecture, tp, gpu_kind(gpu).vllm_max_batched_tokens),
    }
    payload["monotone_envelope"] = _raised(pricer, payload)
    table = StepTable.from_payload(payload, origin="fresh tabulation")
    seed = zlib.crc32(gpu.encode())
    payload["interpolation_error"] = interpolation_error(pricer, table, seed)
    return payload


def gpus_payload() -> dict[str, Any]:
    """Every GPU kind of :data:`COMBINATIONS` from AIConfigurator's system files."""
    import yaml

    kinds: dict[str, Any] = {}
    for gpu in dict.fromkeys(gpu for gpu, _, _ in COMBINATIONS):
        spec = yaml.safe_load((_package_root() / "systems" / f"{gpu}.yaml").read_text())
        kinds[gpu] = {
            "memory_bytes": int(spec["gpu"]["mem_capacity"]),
            "memory_bandwidth": float(spec["gpu"]["mem_bw"]),
            "bf16_flops": float(spec["gpu"]["bfloat16_tc_flops"]),
            "nccl_bytes": {str(k): int(v) for k, v in spec["misc"]["nccl_mem"].items()},
            "other_bytes": int(spec["misc"]["other_mem"]),
            "source": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)} systems/{gpu}.yaml",
        }
    return {"format": "kvshare-twin-gpus", "version": 1, "gpus": kinds}


def architectures_payload() -> dict[str, Any]:
    """Every architecture's config fields, from AIConfigurator's ``model_configs/``."""
    found: dict[str, Any] = {}
    for name, aic_name in ARCHITECTURES.items():
        path = _package_root() / "model_configs" / f"{slug(aic_name)}_config.json"
        config = json.loads(path.read_text())
        found[name] = {field: config.get(field) for field in CONFIG_FIELDS}
        found[name]["source"] = (
            f"{PACKAGE}=={importlib.metadata.version(PACKAGE)} model_configs/{path.name}"
        )
    return {"format": "kvshare-twin-architectures", "version": 1, "architectures": found}


def _write(path: Path, payload: dict[str, Any]) -> None:
    """JSON with one top-level key per line (the grids compact on theirs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in payload.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


def check(points: int, seed: int = 0) -> float:
    """Recompute ``points`` random grid points of every committed table; the largest
    relative difference."""
    rng = random.Random(seed)
    worst = 0.0
    for gpu, architectures, tps in COMBINATIONS:
        for architecture in architectures:
            for tp in tps:
                payload = json.loads(table_path(gpu, architecture, tp).read_text())
                pricer = Pricer(gpu, architecture, tp)
                for _ in range(points):
                    worst = max(worst, regenerated_error(pricer, payload, rng))
    return worst


def regenerated_error(pricer: Pricer, payload: dict[str, Any], rng: random.Random) -> float:
    """Relative difference between one random grid point of ``payload`` and a fresh
    computation of it (the envelope up to it: the most any batch up to it takes)."""
    kind = rng.choice(("linear", "prefill_attention", "decode_attention"))
    part = payload[kind]
    if kind == "linear":
        index = rng.randrange(len(part["tokens"]))
        stored = part["ms"][index]
        fresh = max(pricer.linear(t) for t in part["tokens"][: index + 1])
    else:
        prefill = kind == "prefill_attention"
        axes = ("prompts", "lengths") if prefill else ("requests", "contexts")
        i, j = rng.randrange(len(part[axes[0]])), rng.randrange(len(part[axes[1]]))
        price = pricer.prefill_attention_in_prompts if prefill else pricer.decode_attention
        stored = part["ms"][i][j]
        fresh = max(price(a, part[axes[1]][j]) for a in part[axes[0]][: i + 1])
    return abs(stored - fresh) / max(fresh, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="tabulate only this GPU kind")
    parser.add_argument("--check", type=int, metavar="N", help="recompute N points per table")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # it logs every fallback row it does not use
    sys.path.insert(0, str(ROOT / "src"))
    if args.check:
        print(f"largest relative difference: {check(args.check):.2e}")
        return 0
    _write(DATA / "gpus.json", gpus_payload())
    _write(DATA / "architectures.json", architectures_payload())
    for gpu, architectures, tps in COMBINATIONS:
        if args.only and gpu != args.only:
            continue
        for architecture in architectures:
            for tp in tps:
                payload = tabulate(gpu, architecture, tp)
                _write(table_path(gpu, architecture, tp), payload)
                raised = payload["monotone_envelope"]
                print(
                    f"{gpu:<9} {architecture:<26} tp{tp}: the monotone envelope raised "
                    f"{raised['points']} of {raised['of']} grid points, at most by "
                    f"{raised['largest']:.1%}"
                )
                whole, split = (
                    payload["interpolation_error"][kind] for kind in ("whole_prompts", "any_split")
                )
                print(
                    f"{gpu:<9} {architecture:<26} tp{tp}: interpolation error, whole prompts "
                    f"median {whole['median']:.2%} p95 {whole['p95']:.2%} max "
                    f"{whole['max']:.2%}; any split median {split['median']:.2%} p95 "
                    f"{split['p95']:.2%} max {split['max']:.2%}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
