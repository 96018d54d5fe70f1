"""Start one vLLM GPU worker as vLLM's executor does, on a GPU another engine shares.

``python -m tests.engines.vllm.start_worker --held BYTES [--kvshare] [--size]`` builds
vLLM's config for a tiny local model (a ``config.json``, no weights), then runs the
executor's first two steps on the worker — ``WorkerWrapperBase.init_worker`` and
``init_device`` — over the device layer of ``fake_gpu.py``: an 80 GiB GPU of which other
processes hold ``--held``. With ``--kvshare`` the runtime's patches are applied first, as
the ``sitecustomize`` hook does. With ``--size`` the worker then sizes its KV cache, as the
engine core asks it to (``determine_available_memory``); its profiling forward pass, which
runs the model's kernels on the device, stands in as a no-op. Prints one JSON line:
``{"started": true, "requested": bytes, "utilization": fraction, "extensible": bool or
null[, "kv_bytes": bytes]}`` or ``{"started": false, "error": type, "message": text}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tests.engines.vllm import fake_gpu
from tests.engines.vllm.kv_setup import model_config

TOTAL = 80 * fake_gpu.GIB


def start(model_dir: Path, with_kvshare: bool, size: bool) -> dict[str, object]:
    if with_kvshare:
        from kvshare.runtime.engines.activation import activate

        activate("vllm")
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    model = model_config(model_dir)
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
    worker = wrapper.worker
    cache = worker.cache_config
    result: dict[str, object] = {
        "started": True,
        "requested": int(worker.requested_memory),
        "utilization": getattr(cache, "resolved_gpu_memory_utilization", None)
        or cache.gpu_memory_utilization,
        "extensible": getattr(cache, "enable_extensible_kv_cache", None),
    }
    if size:
        worker.model_runner.profile_run = lambda **kwargs: None  # the model's kernels
        result["kv_bytes"] = int(worker.determine_available_memory())
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", type=int, required=True, help="bytes other processes hold")
    parser.add_argument("--kvshare", action="store_true", help="apply kvshare's patches first")
    parser.add_argument("--size", action="store_true", help="then size the KV cache")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # up to 0.33: V2 needs Triton
    fake_gpu.install(fake_gpu.Gpu(total=TOTAL, held_by_others=args.held))
    with tempfile.TemporaryDirectory() as model_dir:
        result = start(Path(model_dir), args.kvshare, args.size)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's distributed state and threads need no orderly teardown here


if __name__ == "__main__":
    sys.exit(main())
