"""A seeded, bursty multi-model request trace, and the capacity its load is measured in.

The generator
-------------
``M`` models share one GPU for ``duration_s`` seconds. The duration is cut into
``cycles * M`` equal windows; model ``m`` is *busy* in windows ``m, m + M, m + 2M, ...``
and *quiet* in the others, so the bursts are staggered: at any moment one model is busy
and the rest are quiet. Within a phase, requests arrive as a Poisson process with a
constant rate. A client waits ``patience_s`` for its first token and then gives up: the
request is *abandoned* and counts as not served (the engine simulation applies it).

Every parameter is a field of :class:`TraceConfig`, saved with the trace (``--trace
FILE``), so a run can be checked and reproduced. The defaults, and why:

- ``models = 4``, ``duration_s = 144`` (``cycles = 1``): four models, each busy for one
  36 s window. Four models per GPU is a common multi-tenant layout (and makes a static
  share a quarter of the GPU). The demo runs the trace four times as fast as the wall
  clock (``kvshare.demo.options.DEFAULT_SPEED``), so 144 s of trace fit a demo that
  must finish within a minute on two cores; the speed-up only ever costs elastic sharing
  (kvshare's own delays keep wall time). Production bursts last minutes; see *What to
  expect* for what shorter windows cost the comparison.
- ``gpu_memory_bytes = 4 GiB``: the KV memory of the fake GPU (host memory stands in).
- ``kv_bytes_per_token = 128 KiB``: a Llama-3-8B-class model (32 layers x K and V x 8
  KV heads x 128 head dim x 2 bytes); ``block_tokens = 16``: vLLM's default block size.
- The engine's step cost (:class:`~kvshare.demo.step_cost.StepCost`), that of an
  8B model in bf16 on a GPU with 800 GB/s of memory bandwidth and 362 dense bf16
  TFLOP/s (an L40S-class card: 864 GB/s, 362 TFLOP/s):

  - ``step_s = 0.02``: every step reads the 16 GB of weights once: 20 ms, so one
    request alone streams 50 tokens/s;
  - ``step_token_s = 88e-6``: each token computed in the step (a prompt token of an
    admitted request, or one decoded token per running request) costs 2 x 8e9 FLOPs,
    88 us at half the peak compute; a step of 227 tokens takes twice the fixed time;
  - ``step_context_s = 0.16e-6``: attention reads each context token's 128 KiB of KV
    once per step, 0.16 us at 800 GB/s;
  - ``max_step_tokens = 2048``: vLLM's ``max_num_batched_tokens`` for its OpenAI server
    (on CPUs and on GPUs below the H100 class).

  The form is what the real vLLM engine shows (``tools/calibrate_step_cost.py`` measures
  it on a running ``vllm serve``): on this repository's CPU machines, with a tiny model,
  a step took 1.1 ms + 78 us per decoded token + 0.30 us per context token, and a
  prompt's prefill 17 us per token plus a quadratic attention term (load average 3.8 on
  2 cores). The CPU's constants themselves do not carry over: a CPU has a twentieth of a
  GPU's compute per byte of bandwidth and the tiny model's weights are 10 MB, so there a
  step doubles at 14 tokens, and every model would be compute-bound at a handful of
  requests, where KV memory limits nothing (the suite's shared bound is then x0.56-1.14).
  Before the cost per token existed every step took ``step_s`` whatever its batch, so
  throughput grew in proportion to the memory a model held; trace files of that version
  (3) still load and replay with it.
- ``prompt``/``output``: a chat-like size mix, log-normal and clipped (prompt median
  512 tokens, sigma 1.0, in [16, 4096]; output median 128 tokens, sigma 0.9, in
  [8, 1024]) — the shape of public chat traces such as ShareGPT and the Azure LLM
  inference conversation trace: long-tailed prompts, shorter outputs.
- ``prefix_share = 0.5`` of the requests start with their model's system prompt, a fixed
  prefix of ``prefix_tokens_low`` to ``prefix_tokens_high`` (256-1024) tokens drawn once
  per model and counted inside the prompt, which the engines' prefix caches share.
- ``busy_gpu_load = 1`` and ``quiet_load = 0.1``: during its burst a model asks for what
  the whole GPU could serve (``models`` static shares), and a quiet model for a tenth of
  what its static share could serve (below) — a 40x swing between a model's busy and
  quiet traffic, within what multi-model fleets see.
- ``patience_s = 10``: interactive clients do not wait forever. Ten seconds is the
  classic limit for keeping a user's attention on a dialogue (J. Nielsen, "Response
  Times: The 3 Important Limits"); chat front ends aim for a first token within a second
  or two, so 10 s is at the patient end. A longer patience favours static partitions
  (their queues go on serving a burst after it ends), so this choice does not flatter
  elastic sharing: over seeds 0-4 instant sharing gains x1.44-1.59 with 5 s of
  patience, x1.39-1.58 with 10 s, x1.27-1.41 with 30 s and x1.23-1.28 with clients that
  never leave (see below).

The load, and why it is not tuned to flatter
--------------------------------------------
Load is stated relative to what a *static equal share* of the GPU can serve. A request
holding ``P`` prompt tokens that generates ``O`` tokens occupies ``sum_{t=1..O} ceil((P +
t) / B)`` KV blocks of ``B`` tokens for one step each. A full share of ``S`` blocks
therefore finishes ``S / E[...]`` requests per step (Little's law), or fewer when the
steps' token cap binds, and a step of that batch costs what its tokens and its context
cost (above); the ratio is the share's capacity in requests per second. The expectations
are taken over the size mix (20,000 draws with a fixed seed, so the capacity does not
depend on the trace seed; a request carrying the system prompt is charged only for its
blocks beyond the prompt's full blocks, which one shared chain holds, itself taken out
of the share, and computes only its own prompt tokens). That number is
:func:`share_capacity_rps`, computed per model (the system prompt length differs). A
busy model's arrival rate is ``busy_gpu_load * models`` times it and a quiet model's
``quiet_load`` times it. Static partitions cap each model at one share; elastic sharing
lets the busy model borrow what the quiet ones are not using. The same trace, with the
same seed, drives both worlds.

What to expect from it
----------------------
How much sharing can gain depends on the trace, and :mod:`kvshare.demo.bound` measures
that: it runs the same schedulers on the same trace without memory, once from equal
partitions of blocks and once from one shared pool where a freed block is anyone's at
once. On the default trace instant sharing serves x1.48 the requests of partitions for
seed 0 (x1.39-1.58 over seeds 0-4; x1.76 and x1.73-1.90 when every step cost the same
whatever its batch), below the ``M = 4`` that a busy model served by the whole GPU
instead of a quarter of it would suggest, because:

- a step of four times the batch costs more than one of a single share's batch (its
  prompts, its decoded tokens and its context are four times as many), so four times
  the memory serves about twice as much, not four times;
- a static partition goes on serving a burst's backlog for up to ``patience_s`` after
  the burst, so it gets ``window + patience`` to serve what elastic sharing serves
  within the window, and a quiet model's own traffic is served in both worlds;
- a saturated partition serves the short requests of its queue and drops the rest, so it
  serves more requests than its share of the GPU's block-seconds suggests;
- requests still running when the trace ends count for neither world.

Window length matters most: over seeds 0-4 instant sharing reaches x1.29-1.44 with 9 s
bursts (``--duration 36``), x1.33-1.47 when every model's 18 s burst comes round twice
(``--cycles 2``), and x1.41-1.54 with 72 s bursts (``--duration 288``); three models
(``--models 3``, 48 s bursts) leave x1.30-1.38. The real elastic world gets less than
instant sharing: memory moves page by page through the broker, memory in use comes back
only as its requests finish, from pages that hold other requests' blocks too, and the
broker keeps each model's fair share for it rather than serving whoever asks first.
Counts in an overloaded queue are chaotic: one block more or less per partition moves a
model's served count by a few percent, in both worlds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvshare.demo.step_cost import StepCost

__all__ = [
    "LengthMix",
    "Phase",
    "Request",
    "Trace",
    "TraceConfig",
    "TraceError",
    "assemble",
    "busy_windows",
    "draw_prefix",
    "generate",
    "kv_block_steps",
    "load",
    "model_rng",
    "phases",
    "poisson_requests",
    "save",
    "share_capacity_rps",
]

GIB = 2**30
#: File format marker and version of a saved trace.
FORMAT = "kvshare-demo-trace"
VERSION = 4
#: Version 3 files came from engines whose every step took ``step_s``: they load with no
#: cost per token and no token cap, so they replay as they ran.
_FIXED_STEP_VERSION = 3
#: Draws used to estimate the mean KV cost of one request (fixed: see the module doc).
_CAPACITY_DRAWS = 20_000
_CAPACITY_SEED = 20_240_601


class TraceError(ValueError):
    """A trace configuration or file that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class LengthMix:
    """A clipped log-normal token count: ``clip(round(lognormal(ln median, sigma)))``."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        """One length, within ``[low, high]``."""
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))

    def check(self, name: str) -> None:
        """Raise :class:`TraceError` when the mix cannot produce sensible lengths."""
        if not (1 <= self.low <= self.median <= self.high):
            raise TraceError(f"{name}: need 1 <= low <= median <= high, got {self}")
        if not self.sigma >= 0:
            raise TraceError(f"{name}: sigma must be >= 0, got {self.sigma}")


@dataclass(frozen=True)
class TraceConfig:
    """Everything a trace is generated from; saved with it."""

    seed: int = 0
    duration_s: float = 144.0
    models: int = 4
    #: KV memory of the GPU the models share, in bytes (the demo's fake GPU).
    gpu_memory_bytes: int = 4 * GIB
    #: KV bytes of one token across all layers: 128 KiB is a Llama-3-8B-class model
    #: (32 layers x K and V x 8 KV heads x 128 head dim x 2 bytes).
    kv_bytes_per_token: int = 128 * 2**10
    #: Tokens per KV block (vLLM's default block size).
    block_tokens: int = 16
    #: Seconds of one step of the simulated engines whatever its batch (see
    #: :class:`~kvshare.demo.step_cost.StepCost`).
    step_s: float = 0.02
    #: Seconds per token computed in a step (prompt and decoded tokens).
    step_token_s: float = 88e-6
    #: Seconds per token of context the decoding requests of a step attend to.
    step_context_s: float = 0.16e-6
    #: Most tokens one step computes (vLLM's ``max_num_batched_tokens``; None: no cap).
    max_step_tokens: int | None = 2048
    #: Arrival rate of a busy model, as a fraction of what the whole GPU serves
    #: (``models`` times :func:`share_capacity_rps`).
    busy_gpu_load: float = 1.0
    #: Arrival rate of a quiet model, in the same units.
    quiet_load: float = 0.1
    #: How many times each model's busy window comes round within the duration.
    cycles: int = 1
    #: Seconds a client waits for its first token before it gives up (the request is
    #: abandoned and not served).
    patience_s: float = 10.0
    prompt: LengthMix = field(default_factory=lambda: LengthMix(512, 1.0, 16, 4096))
    output: LengthMix = field(default_factory=lambda: LengthMix(128, 0.9, 8, 1024))
    #: Fraction of requests that start with their model's system prompt.
    prefix_share: float = 0.5
    #: Range of the per-model system prompt length, in tokens.
    prefix_tokens_low: int = 256
    prefix_tokens_high: int = 1024

    def check(self) -> None:
        """Raise :class:`TraceError` naming the first field that is out of range."""
        if self.models < 1:
            raise TraceError(f"models must be >= 1, got {self.models}")
        if not self.duration_s > 0:
            raise TraceError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.step_s > 0 or min(self.step_token_s, self.step_context_s) < 0:
            raise TraceError(
                "need step_s > 0 and step_token_s, step_context_s >= 0, got "
                f"{self.step_s}, {self.step_token_s}, {self.step_context_s}"
            )
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise TraceError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.cycles < 1:
            raise TraceError(f"cycles must be >= 1, got {self.cycles}")
        if not self.patience_s > 0:
            raise TraceError(f"patience_s must be > 0, got {self.patience_s}")
        if self.block_tokens < 1 or self.kv_bytes_per_token < 1:
            raise TraceError("block_tokens and kv_bytes_per_token must be >= 1")
        if self.busy_gpu_load < 0 or self.quiet_load < 0:
            raise TraceError("busy_gpu_load and quiet_load must be >= 0")
        if not 0 <= self.prefix_share <= 1:
            raise TraceError(f"prefix_share must be in [0, 1], got {self.prefix_share}")
        if not 0 < self.prefix_tokens_low <= self.prefix_tokens_high:
            raise TraceError("need 0 < prefix_tokens_low <= prefix_tokens_high")
        self.prompt.check("prompt")
        self.output.check("output")
        if self.prefix_tokens_high >= self.prompt.high:
            raise TraceError("a system prompt must be shorter than prompt.high")
        largest = self.blocks_for(self.prompt.high + self.output.high)
        if largest > self.share_blocks():
            raise TraceError(
                f"the largest request needs {largest} KV blocks but a static share of "
                f"{self.gpu_memory_bytes} bytes over {self.models} models holds only "
                f"{self.share_blocks()}: give the GPU more memory or use fewer models"
            )

    def step_cost(self) -> StepCost:
        """What a step of the simulated engines costs."""
        return StepCost(self.step_s, self.step_token_s, self.step_context_s, self.max_step_tokens)

    def with_fixed_steps(self) -> TraceConfig:
        """This setup on the engines before a step's cost grew with its batch: every step
        takes ``step_s``, with no token cap (what version 3 files ran on)."""
        return dataclasses.replace(self, step_token_s=0.0, step_context_s=0.0, max_step_tokens=None)

    def blocks_for(self, tokens: int) -> int:
        """KV blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_tokens)

    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers."""
        return self.block_tokens * self.kv_bytes_per_token

    def share_blocks(self) -> int:
        """KV blocks in one static equal share of the GPU."""
        return self.gpu_memory_bytes // self.models // self.block_bytes()


@dataclass(frozen=True)
class Request:
    """One request of the trace. ``prompt_tokens`` includes ``prefix_tokens``."""

    rid: int
    model: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    #: Length of the model's system prompt this request starts with (0 = none).
    prefix_tokens: int


@dataclass(frozen=True)
class Phase:
    """A window in which one model's arrival rate is constant."""

    model: int
    start_s: float
    end_s: float
    busy: bool


@dataclass(frozen=True)
class Trace:
    """A generated (or loaded) trace: its configuration and its requests by arrival."""

    config: TraceConfig
    requests: tuple[Request, ...]
    source: str = ""
    """How the requests were made, when not by :func:`generate` from the config (a
    family of the trace suite and its parameters, see :mod:`kvshare.demo.suite`)."""

    def for_model(self, model: int) -> list[Request]:
        """The requests of one model, by arrival."""
        return [r for r in self.requests if r.model == model]


def phases(config: TraceConfig) -> list[Phase]:
    """Each model's busy and quiet windows, in time order per model."""
    windows = config.cycles * config.models
    width = config.duration_s / windows
    return [
        Phase(model, w * width, (w + 1) * width, busy=(w % config.models == model))
        for model in range(config.models)
        for w in range(windows)
    ]


def busy_windows(trace: Trace, bin_s: float | None = None) -> list[Phase]:
    """Each model's busy windows as its requests arrived: the stretches in which it asked
    for more than its static share serves (:func:`share_capacity_rps`, for its own system
    prompt), counted over bins of ``bin_s`` (default a fifth of the patience, well within
    the time a client waits), adjacent busy bins merged. Works for any trace, generated by the
    config's phases or not."""
    config = trace.config
    width = bin_s if bin_s is not None else config.patience_s / 5
    bins = max(1, math.ceil(config.duration_s / width))
    windows: list[Phase] = []
    for model in range(config.models):
        requests = trace.for_model(model)
        prefix = max((r.prefix_tokens for r in requests), default=0)
        capacity = share_capacity_rps(config, prefix)
        counts = [0] * bins
        for request in requests:
            counts[min(bins - 1, int(request.arrival_s / width))] += 1
        start: float | None = None
        for index, count in enumerate([*counts, 0]):
            lo = index * width
            hi = min(config.duration_s, lo + width)
            busy = index < bins and count > capacity * (hi - lo)
            if busy and start is None:
                start = lo
            elif not busy and start is not None:
                windows.append(Phase(model, start, min(lo, config.duration_s), busy=True))
                start = None
    return windows


def _ceil_sum(n: int, block: int) -> int:
    """``sum_{k=1..n} ceil(k / block)`` in closed form."""
    q, r = divmod(n, block)
    return block * q * (q + 1) // 2 + r * (q + 1)


def kv_block_steps(prompt_tokens: int, output_tokens: int, block_tokens: int) -> int:
    """Block-steps one request occupies: ``sum_{t=1..O} ceil((P + t) / B)``."""
    return _ceil_sum(prompt_tokens + output_tokens, block_tokens) - _ceil_sum(
        prompt_tokens, block_tokens
    )


def share_capacity_rps(config: TraceConfig, prefix_tokens: int = 0) -> float:
    """Requests per second one static equal share can serve at most (see module doc).

    ``prefix_tokens`` is the model's system prompt: requests that carry it (a
    ``prefix_share`` of them) do not pay for its full blocks, which one chain holds for all,
    nor compute them again.
    """
    # The seed and the duration do not enter: one estimate serves every trace of a setup.
    return _share_capacity_rps(dataclasses.replace(config, seed=0, duration_s=1.0), prefix_tokens)


@functools.lru_cache(maxsize=1024)
def _share_capacity_rps(config: TraceConfig, prefix_tokens: int) -> float:
    rng = random.Random(_CAPACITY_SEED)
    shared = prefix_tokens // config.block_tokens if prefix_tokens else 0
    block_steps = 0
    tokens = 0
    context = 0
    for _ in range(_CAPACITY_DRAWS):
        prompt, output = config.prompt.draw(rng), config.output.draw(rng)
        computed = prompt
        if prefix_tokens and rng.random() < config.prefix_share:
            prompt = max(prompt, prefix_tokens + 1)
            block_steps -= shared * output
            computed = prompt - shared * config.block_tokens
        block_steps += kv_block_steps(prompt, output, config.block_tokens)
        tokens += computed + output - 1
        # Each of its output - 1 decode steps attends to what it holds then.
        context += (output - 1) * prompt + (output - 1) * output // 2
    draws = _CAPACITY_DRAWS
    cost = config.step_cost()
    # A full share finishes this many requests per step (Little's law over block-steps),
    # unless the steps' token cap allows fewer.
    per_step = (config.share_blocks() - shared) / (block_steps / draws)
    if cost.max_tokens is not None:
        per_step = min(per_step, cost.max_tokens / (tokens / draws))
    step = cost.seconds(per_step * tokens / draws, per_step * context / draws)
    return per_step / step


def generate(config: TraceConfig) -> Trace:
    """The trace for ``config``; the same config always gives the same trace."""
    config.check()
    requests: list[tuple[float, int, int, int, int]] = []
    for model in range(config.models):
        rng = model_rng(config.seed, model)
        prefix = draw_prefix(config, rng)
        capacity = share_capacity_rps(config, prefix)
        for phase in (p for p in phases(config) if p.model == model):
            load = config.busy_gpu_load * config.models if phase.busy else config.quiet_load
            requests += poisson_requests(
                config,
                rng,
                model=model,
                prefix=prefix,
                start_s=phase.start_s,
                end_s=phase.end_s,
                rate=capacity * load,
            )
    return assemble(config, requests)


def model_rng(seed: int, model: int, family: str = "kvshare-demo") -> random.Random:
    """The random stream of one model of one trace: models draw independently."""
    return random.Random(f"{family}:{seed}:{model}")


def draw_prefix(config: TraceConfig, rng: random.Random) -> int:
    """A model's system prompt length, drawn once per model."""
    return rng.randint(config.prefix_tokens_low, config.prefix_tokens_high)


def poisson_requests(
    config: TraceConfig,
    rng: random.Random,
    *,
    model: int,
    prefix: int,
    start_s: float,
    end_s: float,
    rate: float,
) -> list[tuple[float, int, int, int, int]]:
    """Requests arriving as a Poisson process of ``rate`` per second in ``[start_s,
    end_s)``, sizes from the config's mixes, a ``prefix_share`` of them with the model's
    system prompt: ``(arrival, model, prompt, output, prefix)`` rows for :func:`assemble`."""
    rows: list[tuple[float, int, int, int, int]] = []
    if rate <= 0:
        return rows
    t = start_s + rng.expovariate(rate)
    while t < end_s:
        prompt = config.prompt.draw(rng)
        output = config.output.draw(rng)
        with_prefix = 0
        if rng.random() < config.prefix_share:
            with_prefix = prefix
            prompt = max(prompt, prefix + 1)
        rows.append((t, model, prompt, output, with_prefix))
        t += rng.expovariate(rate)
    return rows


def assemble(
    config: TraceConfig, rows: list[tuple[float, int, int, int, int]], source: str = ""
) -> Trace:
    """A trace of ``rows`` (see :func:`poisson_requests`), in arrival order."""
    rows = sorted(rows)
    return Trace(
        config,
        tuple(
            Request(rid, model, round(t, 6), prompt, output, prefix)
            for rid, (t, model, prompt, output, prefix) in enumerate(rows)
        ),
        source,
    )


def save(trace: Trace, path: Path) -> None:
    """Write ``trace`` as JSON (config plus one compact row per request)."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(trace.config),
        "source": trace.source,
        "columns": ["model", "arrival_s", "prompt_tokens", "output_tokens", "prefix_tokens"],
        "requests": [
            [r.model, r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_tokens]
            for r in trace.requests
        ],
    }
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n", encoding="utf-8")


def _config_from(raw: Any, version: int) -> TraceConfig:
    if not isinstance(raw, dict):
        raise TraceError("'config' must be an object")
    known = {f.name for f in fields(TraceConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TraceError(f"unknown config fields: {', '.join(unknown)}")
    values = dict(raw)
    for mix in ("prompt", "output"):
        if mix in values:
            values[mix] = LengthMix(**values[mix])
    config = TraceConfig(**values)
    if version == _FIXED_STEP_VERSION:
        config = config.with_fixed_steps()
    config.check()
    return config


def load(path: Path) -> Trace:
    """Read a trace written by :func:`save`; a bad file is a :class:`TraceError`."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} is not a trace file (not JSON: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TraceError(f"{path} is not a {FORMAT} file")
    version = payload.get("version")
    if version not in (VERSION, _FIXED_STEP_VERSION):
        raise TraceError(f"{path}: trace version {version} is not {VERSION}")
    try:
        config = _config_from(payload.get("config"), version)
        requests = []
        for rid, row in enumerate(payload["requests"]):
            model, arrival, prompt, output, prefix = row
            request = Request(
                rid, int(model), float(arrival), int(prompt), int(output), int(prefix)
            )
            _check_request(request, config)
            requests.append(request)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, TraceError):
            raise TraceError(f"{path}: {exc}") from None
        raise TraceError(f"{path}: malformed trace ({exc})") from None
    if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(requests)):
        raise TraceError(f"{path}: requests must be in arrival order")
    source = payload.get("source", "")
    if not isinstance(source, str):
        raise TraceError(f"{path}: 'source' must be a string")
    return Trace(config, tuple(requests), source)


def _check_request(request: Request, config: TraceConfig) -> None:
    if not 0 <= request.model < config.models:
        raise TraceError(f"request {request.rid}: model {request.model} out of range")
    if not 0 <= request.arrival_s <= config.duration_s:
        raise TraceError(f"request {request.rid}: arrival outside [0, duration_s]")
    if request.prompt_tokens < 1 or request.output_tokens < 1:
        raise TraceError(f"request {request.rid}: prompt and output need >= 1 token")
    if not 0 <= request.prefix_tokens < request.prompt_tokens:
        raise TraceError(f"request {request.rid}: prefix must be shorter than the prompt")
    if config.blocks_for(request.prompt_tokens + request.output_tokens) > config.share_blocks():
        raise TraceError(f"request {request.rid}: larger than a static share of the GPU")
