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
  clock (``kvshare.demo.orchestrator.DEFAULT_SPEED``), so 144 s of trace fit a demo that
  must finish within a minute on two cores; the speed-up only ever costs elastic sharing
  (kvshare's own delays keep wall time). Production bursts last minutes; see *What to
  expect* for what shorter windows cost the comparison.
- ``gpu_memory_bytes = 4 GiB``: the KV memory of the fake GPU (host memory stands in).
- ``kv_bytes_per_token = 128 KiB``: a Llama-3-8B-class model (32 layers x K and V x 8
  KV heads x 128 head dim x 2 bytes); ``block_tokens = 16``: vLLM's default block size.
- ``step_s = 0.02``: one decode step every 20 ms, i.e. 50 tokens/s per stream, what an
  8B model streams on a datacenter GPU. The engines run in the KV-capacity-bound regime
  (a fixed time per step, batch size limited by KV memory), where sharing KV memory
  between models matters.
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
  elastic sharing: over seeds 0-4 instant sharing gains x1.77-1.99 with 5 s of
  patience, x1.73-1.90 with 10 s, x1.54-1.77 with 30 s and x1.55-1.67 with clients that
  never leave (see below).

The load, and why it is not tuned to flatter
--------------------------------------------
Load is stated relative to what a *static equal share* of the GPU can serve. In the
KV-capacity-bound regime a request holding ``P`` prompt tokens that generates ``O``
tokens occupies ``sum_{t=1..O} ceil((P + t) / B)`` KV blocks of ``B`` tokens for one
step each. A share of ``S`` blocks therefore serves at most ``S / (step_s * E[...])``
requests per second (Little's law), the expectation taken over the size mix (20,000 draws
with a fixed seed, so the capacity does not depend on the trace seed; a request carrying
the system prompt is charged only for its blocks beyond the prompt's full blocks, which one
shared chain holds, itself taken out of the share). That number is
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
once. On the default trace instant sharing serves x1.76 the requests of partitions for
seed 0 (x1.73-1.90 over seeds 0-4), below the ``M = 4`` that a busy model served by the
whole GPU instead of a quarter of it would suggest, because:

- a static partition goes on serving a burst's backlog for up to ``patience_s`` after
  the burst, so it gets ``window + patience`` to serve what elastic sharing serves
  within the window, and a quiet model's own traffic is served in both worlds;
- a saturated partition serves the short requests of its queue and drops the rest, so it
  serves more requests than its share of the GPU's block-seconds suggests;
- requests still running when the trace ends count for neither world.

Window length matters most: over seeds 0-4 instant sharing reaches x1.44-1.60 with 9 s
bursts (``--duration 36``), x1.55-1.68 when every model's 18 s burst comes round twice
(``--cycles 2``), and x1.81-2.09 with 72 s bursts (``--duration 288``); three models
(``--models 3``, 48 s bursts) leave x1.47-1.62. The real elastic world gets less than
instant sharing: memory moves page by page through the broker, memory in use comes back
only as its requests finish, from pages that hold other requests' blocks too, and the
broker keeps each model's fair share for it rather than serving whoever asks first.
Counts in an overloaded queue are chaotic: one block more or less per partition moves a
model's served count by a few percent, in both worlds.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "LengthMix",
    "Phase",
    "Request",
    "Trace",
    "TraceConfig",
    "TraceError",
    "generate",
    "kv_block_steps",
    "load",
    "phases",
    "save",
    "share_capacity_rps",
]

GIB = 2**30
#: File format marker and version of a saved trace.
FORMAT = "kvshare-demo-trace"
VERSION = 3
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
    #: Seconds per decode step of the simulated engines.
    step_s: float = 0.02
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
        if not self.step_s > 0:
            raise TraceError(f"step_s must be > 0, got {self.step_s}")
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
    ``prefix_share`` of them) do not pay for its full blocks, which one chain holds for all.
    """
    rng = random.Random(_CAPACITY_SEED)
    shared = prefix_tokens // config.block_tokens if prefix_tokens else 0
    total = 0
    for _ in range(_CAPACITY_DRAWS):
        prompt, output = config.prompt.draw(rng), config.output.draw(rng)
        if prefix_tokens and rng.random() < config.prefix_share:
            prompt = max(prompt, prefix_tokens + 1)
            total -= shared * output
        total += kv_block_steps(prompt, output, config.block_tokens)
    mean_block_seconds = total / _CAPACITY_DRAWS * config.step_s
    return (config.share_blocks() - shared) / mean_block_seconds


def generate(config: TraceConfig) -> Trace:
    """The trace for ``config``; the same config always gives the same trace."""
    config.check()
    requests: list[tuple[float, int, int, int, int]] = []
    for model in range(config.models):
        rng = random.Random(f"kvshare-demo:{config.seed}:{model}")
        prefix = rng.randint(config.prefix_tokens_low, config.prefix_tokens_high)
        capacity = share_capacity_rps(config, prefix)
        for phase in (p for p in phases(config) if p.model == model):
            load = config.busy_gpu_load * config.models if phase.busy else config.quiet_load
            rate = capacity * load
            if rate <= 0:
                continue
            t = phase.start_s + rng.expovariate(rate)
            while t < phase.end_s:
                prompt = config.prompt.draw(rng)
                output = config.output.draw(rng)
                with_prefix = 0
                if rng.random() < config.prefix_share:
                    with_prefix = prefix
                    prompt = max(prompt, prefix + 1)
                requests.append((t, model, prompt, output, with_prefix))
                t += rng.expovariate(rate)
    requests.sort()
    return Trace(
        config,
        tuple(
            Request(rid, model, round(t, 6), prompt, output, prefix)
            for rid, (t, model, prompt, output, prefix) in enumerate(requests)
        ),
    )


def save(trace: Trace, path: Path) -> None:
    """Write ``trace`` as JSON (config plus one compact row per request)."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(trace.config),
        "columns": ["model", "arrival_s", "prompt_tokens", "output_tokens", "prefix_tokens"],
        "requests": [
            [r.model, r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_tokens]
            for r in trace.requests
        ],
    }
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n", encoding="utf-8")


def _config_from(raw: Any) -> TraceConfig:
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
    if payload.get("version") != VERSION:
        raise TraceError(f"{path}: trace version {payload.get('version')} is not {VERSION}")
    try:
        config = _config_from(payload.get("config"))
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
    return Trace(config, tuple(requests))


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
