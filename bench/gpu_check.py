"""``make gpu-check``: what only a machine with an NVIDIA GPU can tell about kvshare.

Needs an NVIDIA GPU with its driver, PyTorch built for CUDA and cuda-python; no engines,
no model downloads, no network. Eight steps (one module each under ``bench/gpucheck/``),
one JSON summary printed last, the whole under 8 minutes:

1. ``gpu_tests`` — the ``gpu``-marked tests (``pytest -m gpu``), run for real.
2. ``page_ops`` — what one pool page costs, call by call (create, map, set access, unmap,
   release), through the backend and through the pool, against the bare driver calls.
3. ``decode`` — a small random-weight decoder decodes a batch with its KV cache in a
   kvshare pool and in plain tensors; ``ratio`` = pool tokens/s over plain tokens/s.
4. ``trade`` — the broker and two worker processes: one fills the GPU's budget, the other
   asks, the first frees, the second maps what the first gave back.
5. ``fence`` — a kernel reads KV blocks while another thread frees them and the pool
   unmaps their pages: no fault, no stale read, and the pages go once it is done.
6. ``colocated_start`` — two processes start an engine-like worker on one GPU through the
   broker, together: each takes its start-up turn, loads its "weights", passes the
   free-memory check a patched vLLM makes (against what kvshare grants it) and opens its
   pool; both must get through.
7. ``lease_enforcement`` — the node agent on NVML and a worker that allocates 1 GiB of
   device memory outside its pool: the agent's audit must see it (NVML's per-process
   memory), count it and reclaim the excess from the worker's lease; nothing while the
   worker holds only its pool.
8. ``shared_compute`` — one worker decoding alone, then two together: how much a step
   stretches while another process keeps the GPU busy, against the twin's time-slicing
   (twice as long); the measurement the twin's sharing model waits for.

``--write BENCHMARKS.md`` records the results in the report's GPU section, which
``make bench`` keeps. ``--dry-run`` (``make gpu-check --dry-run``) runs every step on a
machine without a GPU — the ``host`` backend instead of ``cuda``, libc calls instead of the
driver's, the decoder and the kernels on the CPU — so the check itself is known to work
before GPU time is spent on it. Without ``--dry-run`` on a machine without a GPU it stops
at once with status 3 and says so. Exit status: 0 all steps passed, 1 a step failed, 3 no
GPU, 4 a package is missing (the node agent's generated kubelet API stubs are made first if
grpcio-tools is there).
"""

from __future__ import annotations

import os
import sys

# `python bench/gpu_check.py` puts bench/ first on sys.path, where bench/operator.py would
# shadow Python's own `operator` module: bench/ goes last.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from gpucheck.colocated import start_worker  # noqa: E402 - after the path set-up above
from gpucheck.machine import Setup, missing_packages, no_gpu_reason  # noqa: E402
from gpucheck.overuse import overuse_worker  # noqa: E402
from gpucheck.sharing import sharing_worker  # noqa: E402
from gpucheck.summary import STEPS, gpu_section, run_steps  # noqa: E402
from gpucheck.trade import trade_worker  # noqa: E402

EXIT_FAILED = 1
EXIT_NO_GPU = 3
EXIT_MISSING = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, CPU")
    parser.add_argument("--write", metavar="FILE", help="record the results in FILE's GPU section")
    parser.add_argument(
        "--skip", action="append", default=[], choices=sorted(STEPS), help="leave a step out"
    )
    parser.add_argument("--trade-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--start-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--overuse-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--sharing-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trade_worker:
        return trade_worker(args.trade_worker)
    if args.start_worker:
        return start_worker(args.start_worker)
    if args.overuse_worker:
        return overuse_worker(args.overuse_worker)
    if args.sharing_worker:
        return sharing_worker(args.sharing_worker)
    if not args.dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            print(
                f"gpu-check: no GPU on this machine: {reason}. It needs an NVIDIA GPU with its "
                "driver and a CUDA build of PyTorch; `make gpu-check --dry-run` runs the "
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
