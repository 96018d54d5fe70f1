"""Step times from measured kernels: the tables ``tools/tabulate_steps.py`` writes.

AIConfigurator (``aiconfigurator-core``) prices one mixed prefill/decode step of an
engine as the sum of three passes, each from NVIDIA's measured kernel data for the GPU
(GEMMs and attention measured, norms and activations from fitted formulas; every file
says which op came from where):

- the non-attention ops over all the step's tokens (it depends on nothing else),
- the prefill's attention: ``P`` prompt tokens of prompts of ``L`` tokens (tabulated
  against ``P / L``, the prompts' worth of tokens, so that whole prompts lie on grid
  lines: below one it is a chunk of a prompt, above one several prompts),
- the decode attention: ``D`` requests with ``C`` cached tokens each.

Each pass is tabulated on its own axes (:data:`kvshare.twin.data` ``steps/``), and a
step of the twin costs the sum of the three looked up, ``L`` and ``C`` taken as the
step's token-weighted prompt length and its decoding requests' mean context
(:class:`~kvshare.demo.step_cost.StepWork`). Lookups interpolate linearly in the step's
tokens, and bilinearly in the logarithms of both axes and of the time for the attention
passes (attention is close to a power law in each); beyond a table's last point they
extrapolate from the last segment. Each table records how far this lands from
AIConfigurator's own ``mixed_step_latency`` at random points off the grid.

The twin reads only these files: no AIConfigurator, no pandas at run time.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from kvshare.demo.step_cost import StepWork

__all__ = [
    "FORMAT",
    "MissingTableError",
    "StepMemory",
    "StepTable",
    "TableStepCost",
    "load_table",
    "table_name",
    "tabulated",
]

FORMAT = "kvshare-twin-steps"


class MissingTableError(LookupError):
    """No step table for a (GPU, architecture, engine, tensor-parallel) combination."""


@dataclass(frozen=True)
class StepMemory:
    """What the engine keeps on one GPU beside its weights and KV cache (bytes), from
    AIConfigurator's vLLM memory model at the GPU's ``max_num_batched_tokens``."""

    activation_bytes: int
    nccl_bytes: int
    other_bytes: int
    #: AIConfigurator's own count of the weights (its output head counted even when tied).
    aic_weight_bytes: int


class _Curve:
    """Piecewise-linear ``y(x)``, extrapolated from the end segments."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) < 2 or len(xs) != len(ys) or list(xs) != sorted(set(xs)):
            raise ValueError("a curve needs two or more increasing x with one y each")
        self.xs = list(map(float, xs))
        self.ys = list(map(float, ys))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


class _LogSurface:
    """``z(a, b)`` on a grid, bilinear in ``(log a, log b, log z)``."""

    def __init__(
        self, a: Sequence[float], b: Sequence[float], z: Sequence[Sequence[float]]
    ) -> None:
        if len(z) != len(a) or any(len(row) != len(b) for row in z):
            raise ValueError("a surface needs one row per a and one value per b in each")
        self.la = [math.log(v) for v in a]
        self.lb = [math.log(v) for v in b]
        self.lz = [[math.log(max(v, 1e-9)) for v in row] for row in z]
        if self.la != sorted(set(self.la)) or self.lb != sorted(set(self.lb)):
            raise ValueError("a surface's axes must increase")

    def __call__(self, a: float, b: float) -> float:
        x, y = math.log(a), math.log(b)
        la, lb, lz = self.la, self.lb, self.lz
        i = min(max(bisect.bisect_right(la, x) - 1, 0), len(la) - 2)
        j = min(max(bisect.bisect_right(lb, y) - 1, 0), len(lb) - 2)
        fx = (x - la[i]) / (la[i + 1] - la[i])
        fy = (y - lb[j]) / (lb[j + 1] - lb[j])
        low = lz[i][j] + (lz[i][j + 1] - lz[i][j]) * fy
        high = lz[i + 1][j] + (lz[i + 1][j + 1] - lz[i + 1][j]) * fy
        return math.exp(low + (high - low) * fx)


@dataclass(frozen=True)
class StepTable:
    """The step times of one (GPU, architecture, engine, tensor-parallel size)."""

    gpu: str
    architecture: str
    engine: str
    tensor_parallel: int
    memory: StepMemory
    #: Where the numbers come from (package version, perf-data folder, op sources), the
    #: grid, and the interpolation error, as the file states them.
    provenance: dict[str, Any]
    _linear: _Curve
    _prefill: _LogSurface
    _decode: _LogSurface

    @classmethod
    def from_payload(cls, payload: dict[str, Any], origin: str) -> StepTable:
        """A table from a parsed file (``origin`` names it in errors)."""
        try:
            if payload["format"] != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            linear, prefill, decode = (
                payload["linear"],
                payload["prefill_attention"],
                payload["decode_attention"],
            )
            memory = payload["memory"]
            return cls(
                gpu=str(payload["gpu"]),
                architecture=str(payload["architecture"]),
                engine=str(payload["engine"]),
                tensor_parallel=int(payload["tensor_parallel"]),
                memory=StepMemory(
                    int(memory["activation_bytes"]),
                    int(memory["nccl_bytes"]),
                    int(memory["other_bytes"]),
                    int(memory["aic_weight_bytes"]),
                ),
                provenance={key: payload.get(key) for key in ("source", "interpolation_error")},
                _linear=_Curve(linear["tokens"], linear["ms"]),
                _prefill=_LogSurface(prefill["prompts"], prefill["lengths"], prefill["ms"]),
                _decode=_LogSurface(decode["requests"], decode["contexts"], decode["ms"]),
            )
        except (KeyError, TypeError, ValueError) as bad:
            raise ValueError(f"step table {origin} is malformed: {bad}") from None

    def linear_ms(self, tokens: float) -> float:
        """Milliseconds of the non-attention ops over ``tokens`` tokens."""
        return self._linear(tokens)

    def prefill_attention_ms(self, tokens: float, length: float) -> float:
        """Milliseconds of the attention of ``tokens`` prompt tokens of ``length``-token
        prompts."""
        length = max(length, 1.0)
        return self._prefill(tokens / length, length)

    def decode_attention_ms(self, requests: float, context: float) -> float:
        """Milliseconds of the attention of ``requests`` decoding requests with ``context``
        cached tokens each."""
        return self._decode(requests, max(context, 1.0))

    def step_ms(self, work: StepWork) -> float:
        """Milliseconds of one step computing ``work`` on the GPU alone."""
        tokens = work.prefill_tokens + work.decode_requests
        if tokens <= 0:
            return 0.0
        ms = self._linear(tokens)
        if work.prefill_tokens:
            length = work.prefill_attended / work.prefill_tokens
            ms += self.prefill_attention_ms(work.prefill_tokens, length)
        if work.decode_requests:
            context = work.decode_context / work.decode_requests
            ms += self._decode(work.decode_requests, max(context, 1.0))
        return ms


class TableStepCost:
    """The engine's cost model (:class:`~kvshare.demo.step_cost.CostModel`) from a step
    table: what a step takes on the GPU alone."""

    def __init__(self, table: StepTable) -> None:
        self.table = table

    def step_seconds(self, work: StepWork) -> float:
        return self.table.step_ms(work) / 1000.0


def table_name(architecture: str, engine: str, tensor_parallel: int) -> str:
    """The file name of a table under ``data/steps/<gpu>/``."""
    return f"{architecture.replace('/', '--')}--{engine}--tp{tensor_parallel}.json"


def _steps_dir() -> Traversable:
    return resources.files("kvshare.twin").joinpath("data", "steps")


def tabulated() -> list[tuple[str, str, str, int]]:
    """Every (GPU, architecture, engine, tensor-parallel size) with a table."""
    found = []
    for gpu in sorted(_steps_dir().iterdir(), key=lambda p: p.name):
        for path in sorted(gpu.iterdir(), key=lambda p: p.name):
            stem = path.name.removesuffix(".json")
            arch, engine, tp = stem.rsplit("--", 2)
            found.append((gpu.name, arch.replace("--", "/", 1), engine, int(tp.removeprefix("tp"))))
    return found


@functools.cache
def load_table(gpu: str, architecture: str, engine: str, tensor_parallel: int) -> StepTable:
    """The committed table of one combination; a missing one is refused with what exists."""
    path = _steps_dir().joinpath(gpu, table_name(architecture, engine, tensor_parallel))
    if not path.is_file():
        have = ", ".join(
            f"{g}/{a}/{e}/tp{t}" for g, a, e, t in tabulated() if a == architecture or g == gpu
        )
        raise MissingTableError(
            f"no step table for {architecture} on {gpu} ({engine}, tensor_parallel="
            f"{tensor_parallel}); tabulate it with tools/tabulate_steps.py. Tables near it: "
            f"{have or 'none'}"
        )
    payload = json.loads(path.read_text("utf-8"))
    return StepTable.from_payload(payload, origin=str(path))
