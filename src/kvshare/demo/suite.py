"""The trace suite: families of multi-model traffic that a platform sees, several seeds each.

kvshare's default trace (:func:`kvshare.demo.trace.generate`) staggers one burst per model,
which is what elastic sharing is best at. The suite holds it against traffic it was not
tuned on. Every family keeps the default's serving setup (16-token blocks, the simulated
engine's step cost, clients that leave after 10 s without a first token, an equal share of
512 blocks per model on the GPU) and the default's
chat-like lengths unless it says otherwise, and states its load, as the default does,
relative to what one model's static equal share serves (``share_capacity_rps``).
Arrivals are Poisson within windows of constant rate; each model draws from its own
seeded stream, so one model's traffic does not move when another's parameters do.

Families (parameters, and why):

- ``default`` — the demo's own trace (4 models, one 36 s burst each at the whole GPU's
  capacity, 144 s). The baseline the others are measured against.
- ``dominant`` — 6 models, 60 s. One model carries a share of all requests drawn per
  seed in 40-60 % (a flagship model beside long-tail ones), at a constant rate; the other
  five switch between busy (2x their share) and quiet (0.1x) windows with exponential
  durations (busy 10 s, quiet 20 s on average), so their bursts overlap in part. What a
  fleet with one popular model looks like: the big tenant always wants more, the small
  ones must not pay for it.
- ``many`` — 8, 10 or 12 models (by seed), 90 s. Every model is a two-state Markov chain
  (busy 12 s, quiet 30 s on average; busy at 3x its share, quiet at 0.1x), started in
  its stationary state: about three models are busy at any moment, asking for nearly
  the whole GPU together, and who is busy changes at random. Dozens of models on few
  GPUs is the platform teams' case.
- ``diurnal`` — 6 models, 120 s as one compressed day: every model's rate follows the
  same smooth rise and fall (a raised cosine from 0.1x to a peak of 1-3x its share,
  drawn per model), its peak shifted by up to a sixth of the day per model (user bases
  in nearby time zones). Peaks largely coincide, so there is little to gain and the
  point is to lose nothing.
- ``long-context`` — 4 models, 90 s, with twice the KV memory each: prompts of a median
  2,048 tokens with a heavy tail (sigma 1.0, up to 12,000), outputs of a median 256
  (up to 2,048), a fifth of them with the system prompt; Markov bursts as in ``many``
  (busy 15 s, quiet 30 s). Retrieval-augmented and document workloads: few requests,
  each holding a lot of memory for a long time, so memory moves slowly.

Every trace records its family and parameters in :attr:`Trace.source` and saves as a
normal trace file (``kvshare demo --trace FILE`` runs it).

Memory scale: the suite runs three worlds of up to twelve models at once, and the demo's
host memory stands in for GPU memory page for page, so its traces are written at an
eighth of the demo's bytes (:data:`SETUP`: 16 KiB of KV per token, 128 MiB per model
instead of 128 KiB and 1 GiB). Nothing else moves: a share holds the same 512 blocks, a
page the same 8 blocks, a lease chunk the same one page, so the engines, the pools and
the broker do exactly what they would at full size.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvshare.demo.trace import (
    LengthMix,
    Trace,
    TraceConfig,
    assemble,
    draw_prefix,
    generate,
    model_rng,
    poisson_requests,
    share_capacity_rps,
)

__all__ = ["FAMILIES", "SETUP", "Family", "SuiteTrace", "make", "suite"]

#: The suite's serving setup: the demo's, at an eighth of its bytes (see the module doc).
SETUP = dataclasses.replace(
    TraceConfig(), kv_bytes_per_token=16 * 2**10, gpu_memory_bytes=512 * 2**20
)

Rows = list[tuple[float, int, int, int, int]]


@dataclass(frozen=True)
class Family:
    """A generator of one kind of traffic, and the seeds the suite runs it with."""

    name: str
    make: Callable[[int, TraceConfig], Trace]
    """``(seed, base) -> trace``; ``base`` is the serving setup (engine cost, KV per
    token, patience...) the family's own settings start from."""
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class SuiteTrace:
    """One trace of the suite."""

    family: str
    seed: int
    trace: Trace

    @property
    def name(self) -> str:
        return f"{self.family}-{self.seed}"


def _per_model(base: TraceConfig) -> int:
    """The KV memory of one model's equal share in the base setup."""
    return base.gpu_memory_bytes // base.models


def _markov_windows(
    rng: random.Random, duration_s: float, busy_s: float, quiet_s: float
) -> list[tuple[float, float, bool]]:
    """Alternating busy and quiet windows with exponential lengths (means ``busy_s`` and
    ``quiet_s``), the first state drawn from the chain's stationary distribution."""
    busy = rng.random() < busy_s / (busy_s + quiet_s)
    t = 0.0
    windows = []
    while t < duration_s:
        length = rng.expovariate(1 / (busy_s if busy else quiet_s))
        windows.append((t, min(duration_s, t + length), busy))
        t += length
        busy = not busy
    return windows


def _markov_rows(
    config: TraceConfig,
    family: str,
    seed: int,
    models: range,
    *,
    busy_s: float,
    quiet_s: float,
    busy_load: float,
    quiet_load: float,
) -> Rows:
    rows: Rows = []
    for model in models:
        rng = model_rng(seed, model, family)
        prefix = draw_prefix(config, rng)
        capacity = share_capacity_rps(config, prefix)
        for start, end, busy in _markov_windows(rng, config.duration_s, busy_s, quiet_s):
            load = busy_load if busy else quiet_load
            rows += poisson_requests(
                config,
                rng,
                model=model,
                prefix=prefix,
                start_s=start,
                end_s=end,
                rate=capacity * load,
            )
    return rows


def default(seed: int, base: TraceConfig) -> Trace:
    """The demo's own trace (see :mod:`kvshare.demo.trace`)."""
    return generate(dataclasses.replace(base, seed=seed))


def dominant(seed: int, base: TraceConfig) -> Trace:
    """One model with 40-60 % of the requests beside five bursty ones (module doc)."""
    models = 6
    config = dataclasses.replace(
        base, seed=seed, duration_s=60.0, models=models, gpu_memory_bytes=models * _per_model(base)
    )
    share = random.Random(f"dominant:{seed}").uniform(0.4, 0.6)
    rows = _markov_rows(
        config,
        "dominant",
        seed,
        range(1, models),
        busy_s=10.0,
        quiet_s=20.0,
        busy_load=2.0,
        quiet_load=0.1,
    )
    rng = model_rng(seed, 0, "dominant")
    prefix = draw_prefix(config, rng)
    rate = share / (1 - share) * len(rows) / config.duration_s
    rows += poisson_requests(
        config, rng, model=0, prefix=prefix, start_s=0.0, end_s=config.duration_s, rate=rate
    )
    source = (
        f"dominant(seed={seed}, models=6, dominant_share={share:.3f}, "
        "others busy 10 s at 2x, quiet 20 s at 0.1x)"
    )
    return assemble(config, rows, source)


def many(seed: int, base: TraceConfig) -> Trace:
    """8-12 Markov-modulated models whose bursts overlap in part (module doc)."""
    models = (8, 10, 12)[seed % 3]
    config = dataclasses.replace(
        base, seed=seed, duration_s=90.0, models=models, gpu_memory_bytes=models * _per_model(base)
    )
    rows = _markov_rows(
        config,
        "many",
        seed,
        range(models),
        busy_s=12.0,
        quiet_s=30.0,
        busy_load=3.0,
        quiet_load=0.1,
    )
    source = f"many(seed={seed}, models={models}, busy 12 s at 3x, quiet 30 s at 0.1x)"
    return assemble(config, rows, source)


def diurnal(seed: int, base: TraceConfig) -> Trace:
    """A compressed day: every model rises and falls, peaks nearly together (module doc)."""
    models = 6
    config = dataclasses.replace(
        base, seed=seed, duration_s=120.0, models=models, gpu_memory_bytes=models * _per_model(base)
    )
    step_s = 2.0
    rows: Rows = []
    for model in range(models):
        rng = model_rng(seed, model, "diurnal")
        prefix = draw_prefix(config, rng)
        capacity = share_capacity_rps(config, prefix)
        peak = rng.uniform(1.0, 3.0)
        shift = rng.uniform(-1 / 6, 1 / 6) * config.duration_s
        for k in range(math.ceil(config.duration_s / step_s)):
            start = k * step_s
            end = min(config.duration_s, start + step_s)
            phase = 2 * math.pi * ((start + end) / 2 - shift) / config.duration_s
            load = 0.1 + (peak - 0.1) * (0.5 - 0.5 * math.cos(phase))
            rows += poisson_requests(
                config,
                rng,
                model=model,
                prefix=prefix,
                start_s=start,
                end_s=end,
                rate=capacity * load,
            )
    source = f"diurnal(seed={seed}, models=6, peaks 1-3x, shifts up to 1/6 day)"
    return assemble(config, rows, source)


def long_context(seed: int, base: TraceConfig) -> Trace:
    """Long, heavy-tailed prompts: few requests, each holding much memory (module doc)."""
    models = 4
    config = dataclasses.replace(
        base,
        seed=seed,
        duration_s=90.0,
        models=models,
        gpu_memory_bytes=2 * models * _per_model(base),
        prompt=LengthMix(2048, 1.0, 128, 12_000),
        output=LengthMix(256, 0.9, 16, 2048),
        prefix_share=0.2,
    )
    rows = _markov_rows(
        config,
        "long-context",
        seed,
        range(models),
        busy_s=15.0,
        quiet_s=30.0,
        busy_load=3.0,
        quiet_load=0.1,
    )
    source = (
        f"long-context(seed={seed}, models=4, prompts median 2048 up to 12000, busy 15 s at 3x)"
    )
    return assemble(config, rows, source)


#: The suite, in report order.
FAMILIES: tuple[Family, ...] = (
    Family("default", default, (0, 1)),
    Family("dominant", dominant, (0, 1)),
    Family("many", many, (0, 1, 2)),
    Family("diurnal", diurnal, (0, 1)),
    Family("long-context", long_context, (0, 1)),
)


def make(family: str, seed: int, base: TraceConfig | None = None) -> Trace:
    """One trace of a family (``base``: the serving setup, default :data:`SETUP`);
    ValueError names the families."""
    for known in FAMILIES:
        if known.name == family:
            return known.make(seed, base or SETUP)
    raise ValueError(
        f"unknown trace family {family!r}; known: {', '.join(f.name for f in FAMILIES)}"
    )


def suite(base: TraceConfig | None = None, seeds: range | None = None) -> list[SuiteTrace]:
    """Every trace of the suite (``base``: the serving setup, default :data:`SETUP`).

    ``seeds``: these seeds of every family instead of the suite's own, for measuring a
    policy on more traffic than the suite runs with real processes, or on seeds it was
    not tuned on.
    """
    setup = base or SETUP
    return [
        SuiteTrace(f.name, seed, f.make(seed, setup))
        for f in FAMILIES
        for seed in (f.seeds if seeds is None else seeds)
    ]
