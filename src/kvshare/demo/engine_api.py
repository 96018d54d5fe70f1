"""What the simulated engine (:mod:`kvshare.demo.engine_sim`) takes and reports: the
requests it reads, the observer it tells of each request's fate, its scheduler limits,
its samples and its counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["EngineRequest", "EngineSample", "EngineStats", "RequestObserver", "SchedulerLimits"]


class EngineRequest(Protocol):
    """What the engine reads of a request (``prompt_tokens`` includes ``prefix_tokens``)."""

    @property
    def rid(self) -> int: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def prefix_tokens(self) -> int: ...


class RequestObserver(Protocol):
    """Told of each request's first token, completion or abandonment, as they happen."""

    def first_token(self, request: EngineRequest, at_s: float) -> None:
        """``request``'s first token came at ``at_s``."""

    def finished(self, request: EngineRequest, first_token_s: float, last_token_s: float) -> None:
        """``request`` produced its last token at ``last_token_s``."""

    def gave_up(self, request: EngineRequest, at_s: float) -> None:
        """``request``'s client gave up at ``at_s`` before its first token."""


@dataclass(frozen=True)
class SchedulerLimits:
    """What one scheduler step may hold (see the module doc)."""

    max_tokens: int | None = None
    """Most tokens one step computes (vLLM's ``max_num_batched_tokens``; None: no cap)."""
    max_running: int = 256
    """Most requests running at once (vLLM's ``max_num_seqs``)."""
    chunked_prefill: bool = False
    """Compute a prompt that does not fit a step's budget over several steps."""

    def __post_init__(self) -> None:
        if self.max_running < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError("need max_running >= 1 and max_tokens >= 1 (or None)")
        if self.chunked_prefill and self.max_tokens is None:
            raise ValueError("chunked prefill needs a token budget per step")


@dataclass(frozen=True)
class EngineSample:
    """The engine's state after one step."""

    t: float
    running: int
    waiting: int
    served: int
    used_blocks: int
    cached_blocks: int


@dataclass
class EngineStats:
    """Counts since the start; ``waits_s`` has one queueing delay per admitted request."""

    arrived: int = 0
    served: int = 0
    abandoned: int = 0
    preemptions: int = 0
    waits_s: list[float] = field(default_factory=list)
    #: Arrival times matching ``waits_s`` (to plot delay against time).
    wait_arrivals_s: list[float] = field(default_factory=list)

    def record_wait(self, wait_s: float, arrival_s: float) -> None:
        """One request's queueing delay (admitted or abandoned)."""
        self.waits_s.append(wait_s)
        self.wait_arrivals_s.append(arrival_s)
