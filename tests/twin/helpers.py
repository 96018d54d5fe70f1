"""Small workloads for the twin's tests, made here (the suite's families are not needed)."""

from __future__ import annotations

import random

from kvshare.twin.workload import ModelSpec, Slo, TwinRequest, Workload

LLAMA = "meta-llama/Llama-3.1-8B"


def onoff(
    *,
    models: int = 2,
    architecture: str = LLAMA,
    gpu: str = "h200_sxm",
    duration_s: float = 30.0,
    busy_rps: float = 8.0,
    quiet_rps: float = 0.5,
    prompt: tuple[int, int] = (64, 1024),
    output: tuple[int, int] = (16, 256),
    seed: int = 0,
    slo: Slo | None = None,
) -> Workload:
    """``models`` models taking turns at being busy (one busy window each), Poisson
    arrivals, prompt and output lengths uniform in the ranges given."""
    rng = random.Random(seed)
    specs = tuple(ModelSpec(f"m{i}", architecture) for i in range(models))
    window = duration_s / models
    requests = []
    for index, spec in enumerate(specs):
        t = rng.expovariate(quiet_rps)
        while t < duration_s:
            requests.append(TwinRequest(t, spec.name, rng.randint(*prompt), rng.randint(*output)))
            busy = index * window <= t < (index + 1) * window
            t += rng.expovariate(busy_rps if busy else quiet_rps)
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("onoff", gpu, specs, tuple(requests), duration_s, slo=slo or Slo(), seed=seed)


def single(
    requests: list[tuple[float, int, int]],
    *,
    models: int = 1,
    architecture: str = LLAMA,
    gpu: str = "h200_sxm",
) -> Workload:
    """Requests ``(arrival, prompt, output)`` given for model ``m0`` (and copies of each
    for every other model, at the same times)."""
    specs = tuple(ModelSpec(f"m{i}", architecture) for i in range(models))
    made = [
        TwinRequest(t, spec.name, prompt, output)
        for t, prompt, output in requests
        for spec in specs
    ]
    made.sort(key=lambda r: r.arrival_s)
    return Workload("single", gpu, specs, tuple(made), max(t for t, _, _ in requests) + 1)
