"""Workload families: arrival shapes from published characterizations of production LLM
traffic, with request lengths from real conversations.

``generate(family, seed=...)`` builds one :class:`~kvshare.twin.workload.Workload`; the
twin measures each world's capacity on it by scaling its load (``Workload.at_scale``).
Nothing here was fitted to any result of the twin: every parameter is a published number,
a number derived from public data (said how), or a stated round choice.

Common to every family
----------------------
* Models: ``model_class`` ``"8b"`` alternates Llama-3.1-8B and Qwen3-8B; ``"small"``
  alternates Qwen3-0.6B and Qwen3-1.7B. Each family has a default number of models per
  class (:data:`DEFAULT_MODELS`), chosen so the weights leave most of an H200's 141 GB to
  the KV cache (six 8B models hold about 97 GB of weights; sixteen small ones about 37 GB).
* Lengths: ShareGPT first turns (:mod:`kvshare.twin.sharegpt`) counted with each model's
  own tokenizer, within the bounds vLLM's serving benchmark puts on ShareGPT (prompt
  <= 1,024 tokens, prompt + output <= 2,048), except where a family says otherwise.
* Base load (scale 1): a quarter (:data:`BASE_LOAD_SHARE`) of a rough capacity of one
  H200 for the class (:data:`ROUGH_CAPACITY_RPS`), the same rule for every family and
  world. For 8B models: AIConfigurator's measured H200 data put a Llama-3.1-8B decode
  step at 13.9 ms for 128 requests at 2,048 tokens of context, about 9,200 output tokens
  per second; the mean ShareGPT answer within vLLM's bounds is 277 tokens, so about 33
  requests per second, rounded down to 32. Small models: twice that, an assumption (they
  read 5-13x fewer weight bytes per step, but attention over the KV cache and the step's
  fixed costs do not shrink with them). The twin searches the scale from there.
* Duration: :data:`DEFAULT_DURATION_S` of simulated time, so a workload at scale 1 holds
  about 2,000 (8B) or 4,000 (small) requests.
* Shared prefixes: none of the characterizations used here publishes how long the shared
  system prompts of its services are, so no family sets ``prefix_tokens``; a workload
  file can (``docs/workloads.md``).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvshare.twin import arrivals
from kvshare.twin.sharegpt import (
    VLLM_BENCHMARK_FILTER,
    LengthFilter,
    LengthSampler,
    tokenizer_for,
)
from kvshare.twin.workload import ModelSpec, TwinRequest, Workload, WorkloadError
from kvshare.twin.workload_files import KNOWN_GPUS, save_workload

__all__ = [
    "BASE_LOAD_SHARE",
    "CLASS_ARCHITECTURES",
    "DEFAULT_DURATION_S",
    "DEFAULT_MODELS",
    "FAMILIES",
    "MODEL_CLASSES",
    "ROUGH_CAPACITY_RPS",
    "generate",
    "main",
]

MODEL_CLASSES: tuple[str, ...] = ("8b", "small")
CLASS_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "8b": ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B"),
    "small": ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"),
}
#: Rough requests per second one H200 serves of ShareGPT chat for a class (module doc).
ROUGH_CAPACITY_RPS: dict[str, float] = {"8b": 32.0, "small": 64.0}
#: The base load's share of the rough capacity: a moderate operating point.
BASE_LOAD_SHARE = 0.25
DEFAULT_DURATION_S = 240.0

Build = Callable[[random.Random, tuple[ModelSpec, ...], float, float], list[TwinRequest]]


# -- lengths ------------------------------------------------------------------------------


def _chat(
    model: ModelSpec, rng: random.Random, bounds: LengthFilter = VLLM_BENCHMARK_FILTER
) -> Callable[[], tuple[int, int]]:
    sampler = LengthSampler(
        tokenizer_for(model.architecture), seed=rng.getrandbits(32), length_filter=bounds
    )
    return sampler.sample


def _requests(
    model: ModelSpec, times: list[float], lengths: Callable[[], tuple[int, int]]
) -> list[TwinRequest]:
    return [TwinRequest(t, model.name, *lengths()) for t in times]


# -- fleet on/off -------------------------------------------------------------------------

#: Idle periods of at least 10 s (mean 30 s), busy periods of mean 20 s, busy rates swinging
#: over 8x, redrawn every 10 s (see :func:`_fleet_onoff`).
FLEET_ONOFF = arrivals.OnOff(
    mean_on_s=20.0, min_off_s=10.0, mean_extra_off_s=20.0, level_ratio=8.0, level_period_s=10.0
)


def _popularity(count: int, exponent: float) -> list[float]:
    """Zipf weights ``1 / rank ** exponent`` of ``count`` models, summing to 1."""
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    return [weight / sum(raw) for weight in raw]


def _fleet_onoff(
    rng: random.Random, models: tuple[ModelSpec, ...], duration: float, rate: float
) -> list[TwinRequest]:
    """*fleet-onoff*: most models idle most of the time; busy rates swing within a minute.

    Source: the Hyperbolic case study in Prism (Yu et al., "Prism: Unleashing GPU Sharing
    for Cost-Efficient Multi-LLM Serving", arXiv 2505.04021 v2, section 2; also on
    Hyperbolic's case-study page): 24 models over 4 months; "over 60% of models experience
    more than 1,000 idle periods (>10 seconds each)", some idle at least 27 % of the time;
    "request rates can change by more than 5x within just one minute"; "a small number of
    models receive most requests, while many models get minimal traffic (<100
    requests/hour)".

    Shape: each model alternates idle and busy periods (:data:`FLEET_ONOFF`). Every idle
    period lasts at least 10 s, the study's threshold (plus an exponential 20 s on average;
    the study counts periods, not their lengths, so the mean is our choice, made so that a
    few-minute run holds several per model). While busy, the rate is redrawn every 10 s
    from a log-uniform range of 8x, so within a minute it can change more than the study's
    5x. Popularity is Zipf with exponent 1 over the models in a shuffled order (the study's
    long tail is qualitative; exponent 1 is the classic Zipf law). The mean rate of each
    model is its share of the base load.
    """
    weights = _popularity(len(models), 1.0)
    rng.shuffle(weights)
    out: list[TwinRequest] = []
    for model, weight in zip(models, weights, strict=True):
        busy_rate = rate * weight / FLEET_ONOFF.mean_rate(1.0)
        times = arrivals.on_off(rng, busy_rate, FLEET_ONOFF, 0.0, duration)
        out += _requests(model, times, _chat(model, rng))
    return out


# -- diurnal ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Service:
    """One service of the Azure traces: its daily rate swing and its request lengths."""

    name: str
    #: Hour of the day (UTC) of the peak rate, and peak over trough rate.
    peak_hour: float
    peak_over_trough: float
    #: Share of the two services' requests.
    share: float
    #: Percentiles (:data:`_PERCENTILES`) of prompt and output tokens.
    prompt: tuple[int, ...]
    output: tuple[int, ...]


_PERCENTILES = (
    0,
    1,
    5,
    10,
    15,
    20,
    25,
    30,
    35,
    40,
    45,
    50,
    55,
    60,
    65,
    70,
    75,
    80,
    85,
    90,
    95,
    99,
    100,
)
#: Requests in the 2024 traces' week: code 16,803,695; conversation 27,303,999.
_CODE_SHARE = 16_803_695 / (16_803_695 + 27_303_999)
_CODE = _Service(
    "code",
    peak_hour=19.5,
    peak_over_trough=10.0,
    share=_CODE_SHARE,
    prompt=(3, 17, 75, 147, 232, 385, 578, 770, 938, 1075, 1261, 1469, 1690, 1909, 2164, 2433,
            2745, 3193, 3923, 5194, 7315, 7436, 7437),
    output=(6, 6, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13, 14, 16, 18, 20, 24, 29, 39, 55, 90, 252,
            1899),
)  # fmt: skip
_CONVERSATION = _Service(
    "conversation",
    peak_hour=14.5,
    peak_over_trough=2.2,
    share=1.0 - _CODE_SHARE,
    prompt=(2, 29, 181, 207, 372, 387, 396, 403, 414, 703, 984, 1020, 1045, 1071, 1097, 1130,
            1189, 1315, 1877, 2735, 4083, 4142, 14050),
    output=(7, 16, 41, 54, 67, 77, 85, 91, 96, 103, 113, 129, 151, 177, 217, 384, 395, 400, 411,
            424, 451, 601, 1000),
)  # fmt: skip


def _percentile_draw(rng: random.Random, points: tuple[int, ...]) -> int:
    """A draw from the distribution with these percentiles, linear between them."""
    at = rng.uniform(0.0, 100.0)
    for index in range(1, len(_PERCENTILES)):
        if at <= _PERCENTILES[index]:
            low, high = _PERCENTILES[index - 1], _PERCENTILES[index]
            fraction = (at - low) / (high - low)
            value = points[index - 1] + fraction * (points[index] - points[index - 1])
            return max(1, round(value))
    return points[-1]


def _bessel_i0(x: float) -> float:
    """The modified Bessel function I0: the mean of ``exp(x cos t)`` over a period."""
    term, total, k = 1.0, 1.0, 1
    while term > 1e-15 * total:
        term *= (x / (2 * k)) ** 2
        total += term
        k += 1
    return total


def _diurnal(
    rng: random.Random, models: tuple[ModelSpec, ...], duration: float, rate: float
) -> list[TwinRequest]:
    """*diurnal*: a day of code and conversation traffic compressed into the run.

    Source: the Azure LLM inference traces (Azure/AzurePublicDataset). Rates: the 2024
    traces (Stojkovic et al., "DynamoLLM", HPCA 2025; a week of May 2024, invocations per
    minute plotted in the dataset's notebook ``analysis/AzureLLMInferenceDataset2024.ipynb``):
    on weekdays code peaks near 19:00-20:00 UTC at about 5,000 per minute from a trough of
    about 500 near 07:00 (10x); conversation peaks near 14:00-15:00 UTC at about 4,500 from
    about 2,000 (2.2x), so its busy half-day covers the code peak. These four numbers are
    read off the published plot (the week's CSVs are not in the repository). The two
    services' shares are the 2024 traces' request counts, 16,803,695 code and 27,303,999
    conversation. Lengths: the 2023 traces (Patel et al., "Splitwise", ISCA 2024; one hour
    each, ``data/AzureLLMInferenceTrace_code.csv``, 8,819 requests, and ``_conv.csv``,
    19,366): prompts and outputs are drawn from their percentiles (0, 1, 5, 10, ..., 95,
    99, 100, computed from those files), linear between them, prompt and output
    independently (code: median prompt 1,469 and output 13 tokens; conversation: 1,020
    and 129).

    Shape: the first half of the models (rounded down) serve code, the rest conversation.
    ``duration_s`` stands for 24 hours from midnight UTC; each model's rate is
    ``exp(b cos(2 pi (h - peak) / 24))`` normalised to its mean (``b`` from the peak over
    trough ratio), its peak moved by up to an hour either way (drawn per model, so models
    of a service do not peak at the same instant), Poisson around that rate.
    """
    code_models = len(models) // 2
    out: list[TwinRequest] = []
    for index, model in enumerate(models):
        service = _CODE if index < code_models else _CONVERSATION
        peers = code_models if service is _CODE else len(models) - code_models
        share = service.share if code_models else 1.0
        rate_at = _DailyRate(
            mean=rate * share / peers,
            swing=math.log(service.peak_over_trough) / 2.0,
            peak_hour=service.peak_hour + rng.uniform(-1.0, 1.0),
            day_s=duration,
        )
        times = arrivals.thinned(rng, rate_at, rate_at.peak, 0.0, duration)
        draw = random.Random(rng.getrandbits(32))
        out += [
            TwinRequest(
                t,
                model.name,
                _percentile_draw(draw, service.prompt),
                _percentile_draw(draw, service.output),
            )
            for t in times
        ]
    return out


@dataclass(frozen=True)
class _DailyRate:
    """``mean * exp(swing * cos(2 pi (hour - peak_hour) / 24)) / I0(swing)``, with the
    day compressed into ``day_s`` seconds; its mean over the day is ``mean``."""

    mean: float
    swing: float
    peak_hour: float
    day_s: float

    @property
    def peak(self) -> float:
        """The highest rate of the day."""
        return self.mean * math.exp(self.swing) / _bessel_i0(self.swing)

    def __call__(self, t: float) -> float:
        hour = 24.0 * t / self.day_s
        wave = math.cos(2 * math.pi * (hour - self.peak_hour) / 24.0)
        return self.mean * math.exp(self.swing * wave) / _bessel_i0(self.swing)


# -- gamma bursts -------------------------------------------------------------------------

#: Gamma shapes of the gaps between requests: 0.5 for conversation models, 0.25 for API.
GAMMA_SHAPES = {"conversation": 0.5, "api": 0.25}


def _gamma_bursts(
    rng: random.Random, models: tuple[ModelSpec, ...], duration: float, rate: float
) -> list[TwinRequest]:
    """*gamma-bursts*: Gamma-renewal arrivals, burstier than Poisson, conversation and API.

    Source: BurstGPT (Wang et al., "BurstGPT: A Real-World Workload Dataset to Optimize
    LLM Serving Systems", KDD 2025, arXiv 2401.17644; traces of Azure OpenAI GPT services,
    HPMLL/BurstGPT), which models request arrivals with Gamma distributions, separately
    for conversation and API use. The fitted values in the paper could not be read here
    (the trace CSVs are not in the repository's files), so the shapes are those of the
    authors' own workload generator (``example/profile_server/server.py``), which draws the
    gaps between requests from Gamma with shape 0.25 by default and 0.5 otherwise; the gaps'
    coefficient of variation is ``1/sqrt(shape)``: 2 and 1.41, against 1 for Poisson.
    Which of the two goes to API and which to conversation traffic is our choice (API
    callers batch and retry, so they get the burstier one). Lengths: ShareGPT, as that
    generator pairs its arrivals with ShareGPT prompts.

    Shape: models alternate conversation and API (the first is conversation); each has an
    equal share of the base load as its mean rate.
    """
    out: list[TwinRequest] = []
    for index, model in enumerate(models):
        shape = GAMMA_SHAPES["conversation" if index % 2 == 0 else "api"]
        times = arrivals.gamma_renewal(rng, rate / len(models), shape, 0.0, duration)
        out += _requests(model, times, _chat(model, rng))
    return out


# -- zipf small models --------------------------------------------------------------------

ZIPF_EXPONENT = 1.0


def _zipf_small(
    rng: random.Random, models: tuple[ModelSpec, ...], duration: float, rate: float
) -> list[TwinRequest]:
    """*zipf-small*: many models whose popularity falls as a Zipf law of their rank.

    Source: the long-tail popularity Prism reports in production multi-model serving
    (arXiv 2505.04021, Figure 1: four real workloads in which a few models receive most
    requests; Hyperbolic: "many models get minimal traffic (<100 requests/hour)"). The
    characterizations give no exponent; 1 (:data:`ZIPF_EXPONENT`) is the classic Zipf law.

    Shape: model ``i`` (from 0) receives ``1 / (i + 1)`` of the first model's rate, Poisson
    arrivals; the rates add up to the base load. The family is meant for many small models
    (``model_class="small"``, 16 by default).
    """
    out: list[TwinRequest] = []
    for model, weight in zip(models, _popularity(len(models), ZIPF_EXPONENT), strict=True):
        times = arrivals.poisson(rng, rate * weight, 0.0, duration)
        out += _requests(model, times, _chat(model, rng))
    return out


# -- long context -------------------------------------------------------------------------

#: The long-context model's prompts: ShareGPT's long tail, 2,048 tokens and more, with
#: prompt + output within 16,384 tokens (inside every model's context window here).
LONG_PROMPTS = LengthFilter(min_prompt=2048, max_total=16384)


def _long_context(
    rng: random.Random, models: tuple[ModelSpec, ...], duration: float, rate: float
) -> list[TwinRequest]:
    """*long-context*: one model reads long documents beside chat models.

    Lengths: the first model's prompts are ShareGPT first turns of 2,048 tokens or more
    (:data:`LONG_PROMPTS`: 273 under the Llama-3 tokenizer, median prompt 2,664 tokens,
    largest 12,323; 285 under Qwen3's, median 2,833, largest 14,891), real pasted documents
    and code; the other models get chat (vLLM's bounds). Arrivals: Poisson, every model an
    equal share of the base load in requests, so the long model brings most of the prompt
    tokens.
    """
    out: list[TwinRequest] = []
    for index, model in enumerate(models):
        bounds = LONG_PROMPTS if index == 0 else VLLM_BENCHMARK_FILTER
        times = arrivals.poisson(rng, rate / len(models), 0.0, duration)
        out += _requests(model, times, _chat(model, rng, bounds))
    return out


# -- the registry -------------------------------------------------------------------------

_BUILDERS: dict[str, Build] = {
    "fleet-onoff": _fleet_onoff,
    "diurnal": _diurnal,
    "gamma-bursts": _gamma_bursts,
    "zipf-small": _zipf_small,
    "long-context": _long_context,
}
FAMILIES: tuple[str, ...] = tuple(_BUILDERS)
#: Models per family and class when ``n_models`` is not given.
DEFAULT_MODELS: dict[str, dict[str, int]] = {
    "fleet-onoff": {"8b": 6, "small": 12},
    "diurnal": {"8b": 4, "small": 8},
    "gamma-bursts": {"8b": 4, "small": 8},
    "zipf-small": {"8b": 6, "small": 16},
    "long-context": {"8b": 4, "small": 8},
}
MAX_MODELS = 64


def _models(model_class: str, count: int) -> tuple[ModelSpec, ...]:
    architectures = CLASS_ARCHITECTURES[model_class]
    models = []
    for index in range(count):
        architecture = architectures[index % len(architectures)]
        short = architecture.rsplit("/", 1)[-1].lower()
        models.append(ModelSpec(f"{short}-{index:02d}", architecture))
    return tuple(models)


def generate(
    family: str,
    *,
    seed: int,
    gpu: str = "h200_sxm",
    model_class: str = "8b",
    n_models: int | None = None,
    duration_s: float | None = None,
) -> Workload:
    """The workload of ``family`` for ``seed`` (the same arguments give the same workload).

    ``n_models`` and ``duration_s`` default to the family's (:data:`DEFAULT_MODELS`,
    :data:`DEFAULT_DURATION_S`); the base load is the same whatever the count of models.
    """
    if family not in _BUILDERS:
        raise WorkloadError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    if model_class not in MODEL_CLASSES:
        raise WorkloadError(f"model class {model_class!r} is not one of {MODEL_CLASSES}")
    if gpu not in KNOWN_GPUS:
        raise WorkloadError(f"gpu {gpu!r} is not one of {', '.join(KNOWN_GPUS)}")
    count = DEFAULT_MODELS[family][model_class] if n_models is None else n_models
    if not 1 <= count <= MAX_MODELS:
        raise WorkloadError(f"n_models must be 1-{MAX_MODELS}, not {count}")
    duration = DEFAULT_DURATION_S if duration_s is None else duration_s
    if not (math.isfinite(duration) and 0 < duration <= 24 * 3600):
        raise WorkloadError(f"duration_s must be in (0, 86400], not {duration}")
    models = _models(model_class, count)
    rate = BASE_LOAD_SHARE * ROUGH_CAPACITY_RPS[model_class]
    # A string seed is hashed with SHA-512 by random.Random: the same on every platform.
    rng = random.Random(f"{family}/{model_class}/{count}/{duration!r}/{seed}")
    requests = _BUILDERS[family](rng, models, duration, rate)
    requests.sort(key=lambda request: (request.arrival_s, request.model))
    name = f"{family}-{model_class}-{count}m-s{seed}"
    source = (
        f"kvshare.twin.families {family}: seed {seed}, {count} {model_class} models, "
        f"{duration:g} s, base load {rate:g} req/s"
    )
    return Workload(name, gpu, models, tuple(requests), duration, seed=seed, source=source)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvshare.twin.families``: write a family's workload as CSV + YAML."""
    parser = argparse.ArgumentParser(
        prog="python -m kvshare.twin.families",
        description="Write a generated workload as the CSV + YAML files of docs/workloads.md.",
    )
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--model-class", default="8b", choices=MODEL_CLASSES)
    parser.add_argument("--n-models", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="seconds")
    parser.add_argument("--gpu", default="h200_sxm", choices=KNOWN_GPUS)
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    args = parser.parse_args(argv)
    try:
        workload = generate(
            args.family,
            seed=args.seed,
            gpu=args.gpu,
            model_class=args.model_class,
            n_models=args.n_models,
            duration_s=args.duration,
        )
    except WorkloadError as error:
        parser.error(str(error))
    yaml_path, csv_path = save_workload(workload, args.out)
    print(
        f"{len(workload.requests)} requests, {len(workload.models)} models: {yaml_path} {csv_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
