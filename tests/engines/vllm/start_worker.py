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
from tests.engines.vllm.kv_setup import model_config

TOTAL = 80 * fake_gpu.GIB


def start(model_dir: Path, with_kvshare: bool) -> dict[str, object]:
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
    return {"started": True, "requested": int(wrapper.worker.requested_memory)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", type=int, required=True, help="bytes other processes hold")
    parser.add_argument("--kvshare", action="store_true", help="apply kvshare's patches first")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # V2 needs Triton, absent here
    fake_gpu.install(fake_gpu.Gpu(total=TOTAL, held_by_others=args.held))
    with tempfile.TemporaryDirectory() as model_dir:
        result = start(Path(model_dir), args.kvshare)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's distributed state and threads need no orderly teardown here


if __name__ == "__main__":
    sys.exit(main())
