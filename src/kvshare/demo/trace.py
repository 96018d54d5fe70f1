"""A seeded, bursty multi-model request trace, and the capacity its load is measured in.

The generator
-------------
``M`` models share one GPU for ``duration_s`` seconds. The duration is cut into
``cycles * M`` equal windows; model ``m`` is *busy* in windows ``m, m + M, m + 2M, ...``
and *quiet* in the others, so the bursts are staggered: at any moment one model is busy
and the rest are quiet. Within a phase, requests arrive as a Poisson process with a
constant rate.

Request sizes follow a chat-like mix: prompt and output lengths are log-normal, clipped
(prompt median 512 tokens, sigma 1.0, in [16, 4096]; output median 128 tokens, sigma
0.9, in [8, 1024] — the shape of public chat traces such as ShareGPT and the Azure LLM
inference conversation trace: long-tailed prompts, shorter outputs). A share of the
requests (default half) starts with its model's system prompt, a fixed prefix of 256 to
1024 tokens drawn once per model, counted inside the prompt length.

The load, and why it is not tuned to flatter
--------------------------------------------
Load is stated relative to what a *static equal share* of the GPU can serve. In the
KV-capacity-bound regime the simulated engines run in (a fixed time per decode step,
batch size limited by KV memory), a request holding ``P`` prompt tokens that generates
``O`` tokens occupies ``sum_{t=1..O} ceil((P + t) / B)`` KV blocks of ``B`` tokens for one
step each. A share of ``S`` blocks therefore serves at most ``S / (step_s * E[...])``
requests per second (Little's law), the expectation taken over the size mix (20,000 draws
with a fixed seed, so the capacity does not depend on the trace seed; a request carrying
the system prompt is charged only for its blocks beyond the prompt's full blocks, which one
shared chain holds, itself taken out of the share). That number is
:func:`share_capacity_rps`, computed per model (the system prompt length differs). A
busy model's arrival rate is ``busy_load`` times it and a quiet model's ``quiet_load``
times it. The defaults, ``busy_load = 3`` and ``quiet_load = 0.1`` with three models,
mean: during its burst a model asks for what the whole GPU could serve, and a quiet model
asks for a tenth of its share. Static partitions cap each model at one share; elastic
sharing lets the busy model borrow what the quiet ones are not using. Every number here
is a field of :class:`TraceConfig`, saved with the trace (``--trace FILE``), so a run can
be checked and reproduced.

What to expect from it
----------------------
With ``M`` models, one staggered burst each and a busy load of at least ``M`` shares,
the static world is saturated for each model from its burst to the end: it serves about
``M + (M - 1) + ... + 1 = M (M + 1) / 2`` window-shares (plus the quiet requests), while
the elastic world can serve at most ``M * M`` (the whole GPU all the time). Requests
served within the trace's duration can therefore differ by at most ``2 M / (M + 1)``:
x1.5 for three models, less the quiet load. Elastic sharing stays below that bound
because reclaimed memory comes back only as the running requests of the lender finish,
the broker splits the GPU fairly between models that both have a queue, and requests
still running at the end count for neither. The queueing delay is where the difference
is largest: the static world's busy model queues for the rest of the run.
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
VERSION = 1
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
    duration_s: float = 36.0
    models: int = 3
    #: KV memory of the GPU the models share, in bytes (the demo's fake GPU).
    gpu_memory_bytes: int = 4 * GIB
    #: KV bytes of one token across all layers: 128 KiB is a Llama-3-8B-class model
    #: (32 layers x K and V x 8 KV heads x 128 head dim x 2 bytes).
    kv_bytes_per_token: int = 128 * 2**10
    #: Tokens per KV block (vLLM's default block size).
    block_tokens: int = 16
    #: Seconds per decode step of the simulated engines.
    step_s: float = 0.02
    #: Arrival rate of a busy model, in units of :func:`share_capacity_rps`.
    busy_load: float = 3.0
    #: Arrival rate of a quiet model, in the same units.
    quiet_load: float = 0.1
    #: How many times each model's busy window comes round within the duration.
    cycles: int = 1
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
        if self.block_tokens < 1 or self.kv_bytes_per_token < 1:
            raise TraceError("block_tokens and kv_bytes_per_token must be >= 1")
        if self.busy_load < 0 or self.quiet_load < 0:
            raise TraceError("busy_load and quiet_load must be >= 0")
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
            rate = capacity * (config.busy_load if phase.busy else config.quiet_load)
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
