"""Step ``shared_compute``: how co-located engines share the GPU's compute, against the
twin's sharing model.

The twin (:mod:`kvshare.twin.arbiter`) shares a GPU between busy engines by time-slicing
by default: one step at a time, so while two engines with steps of equal length are both
busy, each step takes twice what it takes alone (``TWIN_STRETCH``). This step measures
that on the machine's GPU: one worker process decodes alone for ``RUN_S`` seconds, then
two decode together for as long, each with the ``decode`` step's random-weight decoder
(its KV cache in plain tensors: the pools are not what is measured here), started at
once after their warm-up. ``stretch`` = a worker's mean step time with the other busy
over its step time alone; ``aggregate`` = both workers' steps per second together over
one worker's alone (1.0 under time-slicing; up to 2.0 where the GPU runs both at once).

``within_twin`` says whether ``stretch`` is within 25 % of the twin's; the step fails
only when a worker fails, since the measurement is what the first GPU is for. In a dry
run the workers share the host's cores instead (two cores, two workers: ``stretch`` near
1), which exercises the step, not the twin.
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import time
from typing import IO, Any

from gpucheck.decode import DRY_DECODER, GPU_DECODER, build_decoder, plain_caches
from gpucheck.machine import ROOT, Setup

#: The entry point the worker processes run (``--sharing-worker``).
ENTRY = ROOT / "bench" / "gpu_check.py"
#: Seconds each worker decodes, alone and together.
RUN_S = 5.0
DRY_RUN_S = 1.0
#: What the twin's default sharing (time-slicing) predicts for two equal busy engines.
TWIN_STRETCH = 2.0
#: How far the measured stretch may be from the twin's and still count as within it.
TOLERANCE = 0.25
#: Seconds a worker may take to start, build its decoder and warm up.
START_TIMEOUT_S = 180.0


def sharing_worker(backend_kind: str) -> int:
    """A worker of the step: builds the decoder, says ``ready``, waits for ``go`` with
    the seconds to decode, decodes that long and answers its steps and seconds."""
    import torch

    setup = Setup(dry_run=backend_kind == "host")
    if setup.dry_run:
        # One thread a worker, a core each: two processes of spinning OpenMP threads on
        # two cores slow each other a hundredfold, which would measure the host's threads.
        torch.set_num_threads(1)
    shape = DRY_DECODER if setup.dry_run else GPU_DECODER
    dtype = torch.float32 if setup.dry_run else torch.bfloat16
    model = build_decoder(shape, setup.torch_device, dtype)
    num_blocks = shape.batch * shape.blocks_per_seq
    caches = plain_caches(setup, shape, dtype, num_blocks)
    table = torch.arange(num_blocks, device=setup.torch_device).view(shape.batch, -1)
    tokens = torch.randint(0, shape.vocab, (shape.batch,), device=setup.torch_device)
    for pos in range(shape.prompt, shape.prompt + 4):  # warm-up
        tokens = model.step(tokens, caches, table, pos)
    setup.synchronize()
    _say({"ready": True})
    order = json.loads(sys.stdin.readline())
    steps, pos = 0, shape.prompt
    start = time.perf_counter()
    while time.perf_counter() - start < float(order["seconds"]):
        tokens = model.step(tokens, caches, table, pos)
        setup.synchronize()  # one step at a time, as an engine's loop waits for its step
        steps += 1
        pos = shape.prompt + steps % shape.steps
    _say({"steps": steps, "seconds": time.perf_counter() - start})
    return 0


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _read(stream: IO[str], deadline: float, what: str) -> dict[str, Any]:
    """A worker's next answer, by ``deadline`` (one line: it says nothing more meanwhile)."""
    ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
    line = stream.readline() if ready else ""
    if not line:
        raise RuntimeError(f"a sharing worker ended or stalled before {what}")
    answer: dict[str, Any] = json.loads(line)
    return answer


def _step_ms(setup: Setup, workers: int, seconds: float) -> list[float]:
    """Each of ``workers`` processes' mean step time (ms) while they decode together."""
    command = [sys.executable, str(ENTRY), "--sharing-worker", setup.backend]
    processes = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for process in processes:
            assert process.stdout is not None
            _read(process.stdout, deadline, "it was ready")
        for process in processes:  # released together: each decodes while the others do
            assert process.stdin is not None
            process.stdin.write(json.dumps({"seconds": seconds}) + "\n")
            process.stdin.flush()
        done = []
        for process in processes:
            assert process.stdout is not None
            done.append(_read(process.stdout, deadline + 2 * seconds, "it answered"))
        return [1e3 * d["seconds"] / max(1, d["steps"]) for d in done]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def shared_compute(setup: Setup) -> dict[str, Any]:
    seconds = DRY_RUN_S if setup.dry_run else RUN_S
    alone = _step_ms(setup, 1, seconds)[0]
    together = _step_ms(setup, 2, seconds)
    stretch = statistics.mean(together) / alone
    aggregate = sum(alone / ms for ms in together)
    shape = DRY_DECODER if setup.dry_run else GPU_DECODER
    return {
        "shape": f"{shape.layers} layers, hidden {shape.hidden}, batch {shape.batch}",
        "step_ms_alone": round(alone, 3),
        "step_ms_together": [round(ms, 3) for ms in together],
        "stretch": round(stretch, 3),
        "aggregate": round(aggregate, 3),
        "twin_stretch": TWIN_STRETCH,
        "within_twin": abs(stretch / TWIN_STRETCH - 1.0) <= TOLERANCE,
        "ok": True,
    }
