"""What a GPU twin serves: models on one GPU, their requests, and the latency SLO.

A :class:`Workload` is the unit every world of the twin runs and every capacity figure is
measured on. It is plain data, validated where it is built, so a workload a user brings
(a CSV of requests and a YAML of models, :mod:`kvshare.twin.workload_files`) and one the
suite generates (:mod:`kvshare.twin.families`) are the same kind of object.

Load scaling
------------
Capacity at an SLO is the largest *scale* of a workload's load at which the SLO holds.
:meth:`Workload.at_scale` scales the load without changing its shape in time: every
request of the base workload stands for ``floor(s)`` copies plus one more with probability
``s - floor(s)``, each copy arriving within :data:`COPY_JITTER_S` of the original. The
draw behind each copy is fixed by the workload's seed, so the requests at scale ``s``
are a subset of those at any larger scale: load only grows with the scale, which makes
the search for the largest scale at the SLO a bisection. Idle periods, bursts and their
timing keep their place (compressing time instead would shorten every burst).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = [
    "COPY_JITTER_S",
    "ModelSpec",
    "Slo",
    "TwinRequest",
    "Workload",
    "WorkloadError",
]

#: Seconds within which a copy made by :meth:`Workload.at_scale` arrives after its
#: original (uniformly): copies of one request do not arrive at the same instant.
COPY_JITTER_S = 1.0
#: Most copies one request may stand for (a scale above this is refused).
MAX_SCALE = 64.0


class WorkloadError(ValueError):
    """A workload that cannot be run, with what to change."""


@dataclass(frozen=True)
class ModelSpec:
    """One model server on the GPU.

    ``name`` is how requests name it (unique within a workload); ``architecture`` the
    Hugging Face-style name of its architecture (``meta-llama/Llama-3.1-8B``), which
    decides its weights, KV bytes per token and step times in the twin.
    """

    name: str
    architecture: str
    #: Tensor-parallel size: the GPUs one replica spans (the twin runs one GPU's share).
    tensor_parallel: int = 1
    #: The engine whose kernels and block size the twin uses (``vllm`` or ``sglang``).
    engine: str = "vllm"
    #: Tokens per KV block (None: the engine's default).
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.isprintable() or len(self.name) > 128:
            raise WorkloadError(f"model name {self.name!r}: give 1-128 printable characters")
        if "/" not in self.architecture:
            raise WorkloadError(
                f"model {self.name}: architecture {self.architecture!r} is not a Hugging "
                "Face-style name such as meta-llama/Llama-3.1-8B"
            )
        if self.tensor_parallel < 1:
            raise WorkloadError(f"model {self.name}: tensor_parallel must be >= 1")
        if self.engine not in ("vllm", "sglang"):
            raise WorkloadError(f"model {self.name}: engine must be vllm or sglang")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise WorkloadError(f"model {self.name}: block_tokens must be >= 1")


@dataclass(frozen=True)
class Slo:
    """The latency target every request is held to, and how many must meet it.

    The SLO holds on a run when the 99th percentile of time to first token over all
    requests is at most ``ttft_p99_s``, that of time per output token at most
    ``tpot_p99_ms``, and every model has at least ``min_attainment`` of its requests
    within both targets.
    """

    ttft_p99_s: float = 2.0
    tpot_p99_ms: float = 100.0
    min_attainment: float = 0.95

    def __post_init__(self) -> None:
        for name, value in (("ttft_p99_s", self.ttft_p99_s), ("tpot_p99_ms", self.tpot_p99_ms)):
            if not math.isfinite(value) or value <= 0:
                raise WorkloadError(f"SLO {name} must be a positive number, not {value}")
        if not 0.0 < self.min_attainment <= 1.0:
            raise WorkloadError("SLO min_attainment must be in (0, 1]")


@dataclass(frozen=True)
class TwinRequest:
    """One request: when it arrives, for which model, and its lengths in tokens.

    ``prefix_tokens`` of the prompt (counted inside ``prompt_tokens``) are a prefix the
    model's other requests share (a system prompt), which prefix caching may serve.
    """

    arrival_s: float
    model: str
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise WorkloadError(f"request arrival {self.arrival_s} must be a finite time >= 0")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise WorkloadError(
                f"request at {self.arrival_s} s for {self.model}: prompt and output tokens "
                "must be >= 1"
            )
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise WorkloadError(
                f"request at {self.arrival_s} s for {self.model}: prefix_tokens must be "
                "between 0 and prompt_tokens"
            )


@dataclass(frozen=True)
class Workload:
    """Models sharing one GPU of kind ``gpu``, the requests they receive, and the SLO.

    ``gpu`` names a GPU kind the twin knows (``h200_sxm``, ``h100_sxm``, ...).
    ``requests`` are sorted by arrival; ``duration_s`` is the length of the period they
    arrive in (a run lasts until they are served or given up). ``source`` says where the
    workload comes from (a generator and its parameters, or a user's files), for reports.
    """

    name: str
    gpu: str
    models: tuple[ModelSpec, ...]
    requests: tuple[TwinRequest, ...]
    duration_s: float
    slo: Slo = field(default_factory=Slo)
    seed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.models:
            raise WorkloadError(f"workload {self.name}: no models")
        names = [model.name for model in self.models]
        if len(set(names)) != len(names):
            raise WorkloadError(f"workload {self.name}: model names repeat: {names}")
        if not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise WorkloadError(f"workload {self.name}: duration must be > 0 seconds")
        known = set(names)
        previous = 0.0
        for request in self.requests:
            if request.model not in known:
                raise WorkloadError(
                    f"workload {self.name}: a request names model {request.model!r}, which "
                    f"is not one of {sorted(known)}"
                )
            if request.arrival_s < previous:
                raise WorkloadError(f"workload {self.name}: requests are not sorted by arrival")
            previous = request.arrival_s

    def model(self, name: str) -> ModelSpec:
        """The model called ``name``."""
        for model in self.models:
            if model.name == name:
                return model
        raise WorkloadError(f"workload {self.name}: no model {name!r}")

    def for_model(self, name: str) -> list[TwinRequest]:
        """The requests of one model, in arrival order."""
        return [request for request in self.requests if request.model == name]

    def at_scale(self, scale: float) -> Workload:
        """The same workload with its load multiplied by ``scale`` (see the module's
        *Load scaling*); ``at_scale(1)`` is the workload itself."""
        if not math.isfinite(scale) or not 0 < scale <= MAX_SCALE:
            raise WorkloadError(f"load scale must be in (0, {MAX_SCALE:g}], not {scale}")
        if scale == 1.0:
            return self
        copies: list[TwinRequest] = []
        for number, request in enumerate(self.requests):
            # The draws behind a request's copies depend only on the seed and the
            # request's place, never on the scale: the copies kept at one scale are kept
            # at every larger one. The original is copy 0 and keeps its arrival.
            rng = random.Random(self.seed * 1_000_003 + number)
            for index in range(math.ceil(scale)):
                keep_draw, jitter = rng.random(), rng.random()
                if keep_draw < scale - index:
                    delay = 0.0 if index == 0 else jitter * COPY_JITTER_S
                    copies.append(
                        TwinRequest(
                            request.arrival_s + delay,
                            request.model,
                            request.prompt_tokens,
                            request.output_tokens,
                            request.prefix_tokens,
                        )
                    )
        copies.sort(key=lambda request: request.arrival_s)
        return Workload(
            self.name,
            self.gpu,
            self.models,
            tuple(copies),
            self.duration_s,
            self.slo,
            self.seed,
            self.source,
        )
