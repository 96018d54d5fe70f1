"""Model geometry: what each architecture keeps on a GPU, per token of KV cache and in all.

An architecture's numbers come from its Hugging Face config (copied from
AIConfigurator's ``model_configs/`` into ``data/architectures.json`` by
``tools/tabulate_steps.py``):

- **KV bytes per token**: ``layers x 2 (K and V) x KV heads x head size x dtype bytes``
  (Llama-3.1-8B: 32 x 2 x 8 x 128 x 2 = 128 KiB in bf16);
- **parameters**: embeddings (and an untied output head), per layer the attention
  projections (``q`` and ``o`` over the attention heads, ``k`` and ``v`` over the KV
  heads), the gated MLP (three matrices), two norms and, for Qwen3, the per-head q/k
  norms, and the final norm. Weight bytes are parameters x dtype bytes (bf16: 2).

With tensor parallelism over ``k`` GPUs one GPU holds ``1/k`` of the weights and of the
KV heads (a model with fewer KV heads than GPUs replicates them: one per GPU, as vLLM
does).

Beside its weights, vLLM keeps activations for its largest step, NCCL buffers and the
CUDA context, cuBLAS workspaces and CUDA graphs. The twin takes them from
AIConfigurator's vLLM memory model (``VLLMBackend._get_memory_usage``, recorded in each
step table by ``tools/tabulate_steps.py``): activations ``2 x max_num_batched_tokens x
hidden x c`` bytes (``c`` 11 at TP 1 for Llama-family models), NCCL's buffers (0 at TP 1,
342-392 MiB above), and 3.5 GiB for the rest (AIConfigurator raised it from 551 MiB "for
safer deployment"). So an 8B model on an H200 keeps 15.0 GiB of weights and 4.2 GiB more.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from kvshare.twin.gpus import GpuKind
from kvshare.twin.steps import load_table
from kvshare.twin.workload import ModelSpec

__all__ = [
    "Architecture",
    "DeviceMemory",
    "DoesNotFitError",
    "Footprint",
    "UnknownArchitectureError",
    "architecture",
    "architecture_from_config",
    "check_fits",
    "footprint",
]

GIB = 2**30
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Tokens per KV block of each engine by default (vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE``).
DEFAULT_BLOCK_TOKENS = {"vllm": 16}


class DeviceMemory(Protocol):
    """The memory of the device models are placed on (a GPU kind, or any twin device)."""

    @property
    def name(self) -> str:
        """The device's name."""

    @property
    def usable_bytes(self) -> int:
        """What the engines may use together."""


class UnknownArchitectureError(ValueError):
    """An architecture the twin has no config for."""


class DoesNotFitError(ValueError):
    """Models that one GPU cannot hold, with the numbers."""


@dataclass(frozen=True)
class Architecture:
    """The shape of a transformer, from its Hugging Face config."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    dtype_bytes: int
    max_context: int
    #: Per-head RMS norms on queries and keys (Qwen3).
    qk_norm: bool
    source: str

    @property
    def parameters(self) -> int:
        """Parameters of the model (see the module doc)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * (attention + mlp + norms) + self.hidden

    def kv_heads_per_gpu(self, tensor_parallel: int) -> int:
        """KV heads one GPU holds at tensor-parallel size ``tensor_parallel``."""
        return max(1, self.kv_heads // tensor_parallel)

    def kv_bytes_per_token(self, tensor_parallel: int = 1) -> int:
        """KV cache bytes one token takes on one GPU, all layers, K and V."""
        per_head = self.head_dim * self.dtype_bytes
        return self.layers * 2 * self.kv_heads_per_gpu(tensor_parallel) * per_head

    def weight_bytes(self, tensor_parallel: int = 1) -> int:
        """Weight bytes one GPU holds."""
        return math.ceil(self.parameters * self.dtype_bytes / tensor_parallel)


def architecture_from_config(name: str, config: dict[str, Any], source: str) -> Architecture:
    """The architecture a Hugging Face ``config.json`` describes (``source`` says where it
    came from); a config without the fields the twin reads is refused."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Architecture(
            name=name,
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or hidden // heads),
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES[config["torch_dtype"]],
            max_context=int(config["max_position_embeddings"]),
            qk_norm="Qwen3ForCausalLM" in config["architectures"],
            source=source,
        )
    except (KeyError, TypeError, ValueError) as bad:
        raise UnknownArchitectureError(
            f"config of {name} ({source}) is unusable: {bad!r}"
        ) from None


@functools.cache
def _architectures() -> dict[str, Architecture]:
    raw: dict[str, Any] = json.loads(
        resources.files("kvshare.twin").joinpath("data", "architectures.json").read_text("utf-8")
    )
    return {
        name: architecture_from_config(name, config, str(config["source"]))
        for name, config in raw["architectures"].items()
    }


def architecture(name: str) -> Architecture:
    """The architecture called ``name``; an unknown one is refused with the known ones."""
    known = _architectures()
    if name not in known:
        raise UnknownArchitectureError(
            f"the twin has no config for architecture {name!r}; known: {', '.join(sorted(known))}"
        )
    return known[name]


@dataclass(frozen=True)
class Footprint:
    """What one model server keeps on one GPU of its kind, besides its KV cache."""

    model: str
    architecture: Architecture
    tensor_parallel: int
    block_tokens: int
    weight_bytes: int
    activation_bytes: int
    nccl_bytes: int
    other_bytes: int

    @property
    def static_bytes(self) -> int:
        """Everything but the KV cache: weights, activations, NCCL, CUDA context and graphs."""
        return self.weight_bytes + self.activation_bytes + self.nccl_bytes + self.other_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on this GPU."""
        return self.architecture.kv_bytes_per_token(self.tensor_parallel)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block, all layers, on this GPU."""
        return self.block_tokens * self.kv_bytes_per_token


def footprint(spec: ModelSpec, gpu: GpuKind) -> Footprint:
    """What ``spec`` keeps on one GPU of kind ``gpu`` (its step table must exist: the
    memory beside the weights is recorded there)."""
    arch = architecture(spec.architecture)
    if spec.engine not in DEFAULT_BLOCK_TOKENS:
        raise UnknownArchitectureError(
            f"model {spec.name}: the twin has step tables for the engines "
            f"{', '.join(DEFAULT_BLOCK_TOKENS)} only, not {spec.engine}"
        )
    memory = load_table(gpu.name, spec.architecture, spec.engine, spec.tensor_parallel).memory
    return Footprint(
        model=spec.name,
        architecture=arch,
        tensor_parallel=spec.tensor_parallel,
        block_tokens=spec.block_tokens or DEFAULT_BLOCK_TOKENS[spec.engine],
        weight_bytes=arch.weight_bytes(spec.tensor_parallel),
        activation_bytes=memory.activation_bytes,
        nccl_bytes=memory.nccl_bytes,
        other_bytes=memory.other_bytes,
    )


def kv_budget(footprints: Sequence[Footprint], gpu: DeviceMemory) -> int:
    """Bytes left for KV caches when ``footprints`` share ``gpu``: its usable memory less
    every model's static footprint (negative when they do not fit)."""
    return gpu.usable_bytes - sum(f.static_bytes for f in footprints)


def check_fits(footprints: Sequence[Footprint], gpu: DeviceMemory, kv_needed: Sequence[int]) -> int:
    """The KV budget of ``footprints`` on ``gpu``, or :class:`DoesNotFitError` when it
    cannot hold ``kv_needed[i]`` bytes for model ``i`` (its longest request) at once."""
    usable = gpu.usable_bytes / GIB
    for item in footprints:
        if item.static_bytes >= gpu.usable_bytes:
            raise DoesNotFitError(
                f"model {item.model} ({item.architecture.name}, tensor_parallel="
                f"{item.tensor_parallel}) does not fit a {gpu.name}: its weights "
                f"({item.weight_bytes / GIB:.1f} GiB per GPU) and runtime memory "
                f"({(item.static_bytes - item.weight_bytes) / GIB:.1f} GiB) exceed the "
                f"{usable:.1f} GiB the engines may use; use a larger tensor_parallel or GPU"
            )
    budget = kv_budget(footprints, gpu)
    needed = sum(kv_needed)
    if budget < needed:
        static = sum(f.static_bytes for f in footprints) / GIB
        raise DoesNotFitError(
            f"{len(footprints)} models do not fit one {gpu.name}: their static memory "
            f"({static:.1f} GiB) leaves {max(budget, 0) / GIB:.1f} GiB of the {usable:.1f} "
            f"GiB usable for KV caches, and their longest requests need "
            f"{needed / GIB:.2f} GiB at once; use fewer models, tensor parallelism or a "
            "larger GPU"
        )
    return budget
