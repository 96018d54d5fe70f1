"""What one step of a simulated engine computes, and what it costs.

A scheduler step (:class:`~kvshare.demo.engine_sim.EngineSim`) describes its batch as a
:class:`StepWork`; a :class:`CostModel` turns that into seconds. Two cost models exist:
:class:`StepCost`, the demo's three-term form with constants for an 8B model (see
:mod:`kvshare.demo.trace`), and the GPU twin's tables of measured kernels
(:class:`kvshare.twin.steps.TableStepCost`). The engine knows neither: it hands its work
to whichever it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CostModel", "StepCost", "StepWork"]


@dataclass(frozen=True, slots=True)
class StepWork:
    """The batch of one scheduler step.

    ``prefill_tokens`` are the prompt tokens computed in the step (less a cached prefix;
    a recomputed request's generated tokens included). ``prefill_attended`` is the sum,
    over the prompts (or prompt chunks) in the step, of the tokens each computes times the
    length of the prompt it belongs to: divided by ``prefill_tokens`` it is the
    token-weighted prompt length the prefill's attention covers. ``decode_requests``
    requests each decode one token, attending to ``decode_context`` cached tokens in all.
    ``first_tokens`` requests complete their prompt in the step and get their first token
    with it (a cost model may price what serving a new request costs beyond its compute).
    """

    prefill_tokens: int = 0
    prefill_attended: int = 0
    decode_requests: int = 0
    decode_context: int = 0
    first_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Tokens computed in the step: prompt tokens plus one per decoding request."""
        return self.prefill_tokens + self.decode_requests


class CostModel(Protocol):
    """Seconds one step takes on a device of its own (the engine alone on its GPU)."""

    def step_seconds(self, work: StepWork) -> float:
        """How long a step computing ``work`` takes."""


@dataclass(frozen=True)
class StepCost:
    """What one scheduler step costs, in seconds::

        fixed_s + per_token_s * tokens computed + per_context_token_s * context tokens

    *Tokens computed* are the prompt tokens of the requests admitted in the step (less
    their cached prefix) and one per running request; *context tokens* are the tokens
    already in the KV cache of the running requests, which attention reads once per step.
    """

    fixed_s: float
    """Seconds of a step whatever its batch (reading the weights, scheduling, sampling)."""
    per_token_s: float = 0.0
    """Seconds per token computed in the step (prompt tokens and decoded tokens alike)."""
    per_context_token_s: float = 0.0
    """Seconds per token of KV cache that the step's decoding requests attend to."""
    max_tokens: int | None = None
    """Most tokens one step computes (None: no cap)."""

    def __post_init__(self) -> None:
        if not self.fixed_s > 0 or min(self.per_token_s, self.per_context_token_s) < 0:
            raise ValueError("a step needs fixed_s > 0 and per-token costs >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")

    def seconds(self, tokens: float, context: float = 0.0) -> float:
        """How long a step computing ``tokens`` tokens over ``context`` cached ones takes."""
        return self.fixed_s + self.per_token_s * tokens + self.per_context_token_s * context

    def step_seconds(self, work: StepWork) -> float:
        """:meth:`seconds` of a step's work (the :class:`CostModel` view)."""
        return self.seconds(work.tokens, work.decode_context)
