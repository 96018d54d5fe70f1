"""Start one vLLM GPU worker as vLLM's executor does, on a GPU another engine shares.

``python -m tests.engines.vllm.start_worker --held BYTES [--kvshare]`` builds vLLM's config
for a tiny local model (a ``config.json``, no weights), then runs the executor's first two
steps on the worker — ``WorkerWrapperBase.init_worker`` and ``init_device`` — over the
device layer of ``fake_gpu.py``: an 80 GiB GPU of which other processes hold ``--held``.
With ``--kvshare`` the runtime's patches are applied first, as the ``sitecustomize`` hook
does. Prints one JSON line: ``{"started": true, "requested": bytes}`` or
``{"started": false, "error": type, "message": text}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tests.engines.vllm import fake_gpu

TOTAL = 80 * fake_gpu.GIB
#: A Llama of two small layers: enough for vLLM's config and model runner.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def start(model_dir: Path, with_kvshare: bool) -> dict[str, object]:
    if with_kvshare:
        from kvshare.runtime.engines.activation import activate

        activate("vllm")
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512
    )
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cuda"))
    config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"  # the CUDA worker
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker(
        all_kwargs=[
            {
                "vllm_config": config,
                "local_rank": 0,
                "rank": 0,
                "distributed_init_method": get_distributed_init_method(
                    "127.0.0.1", get_open_port()
                ),
                "is_driver_worker": True,
            }
        ]
    )
    try:
        with fake_gpu.host_tensors():
            wrapper.init_device()
    except Exception as exc:
        return {"started": False, "error": type(exc).__name__, "message": str(exc)}
    return {"started": True, "requested": int(wrapper.worker.requested_memory)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", type=int, required=True, help="bytes other processes hold")
    parser.add_argument("--kvshare", action="store_true", help="apply kvshare's patches first")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # V2 needs Triton, absent here
    fake_gpu.install(fake_gpu.Gpu(total=TOTAL, held_by_others=args.held))
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL))
        result = start(Path(model_dir), args.kvshare)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's distributed state and threads need no orderly teardown here


if __name__ == "__main__":
    sys.exit(main())
