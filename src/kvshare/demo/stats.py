"""What the demo's model servers report, and the static-vs-elastic accounting built on it.

A server sends :class:`Sample` records while it runs and one :class:`ServerResult` at the
end, as JSON lines on its stdout. Everything here is pure: the orchestrator feeds it what
the servers said, and the summary, the live view, the plot and the benchmark read it.

A model's *KV memory* is its lease: the memory it may map and no other model may use
(its whole partition under static partitioning, what the broker lends it when elastic).
What its pool has actually mapped is ``held`` (never grown above the lease) and the part
of that holding blocks is ``used``.

Queueing delay is the time from a request's arrival to its first admission (its first
token). A request whose client gave up first (see the trace's ``patience_s``) is
*abandoned*: it counts with its patience as its delay and is not served. Requests still
queued when the run ends count with the time they have waited so far (a lower bound), so
a long queue cannot hide from the percentiles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "BookViolation",
    "Comparison",
    "Mode",
    "ModelSummary",
    "Sample",
    "ServerResult",
    "check_pool_books",
    "compare",
    "percentile",
    "summarize",
]

Mode = Literal["static", "elastic"]
MODES: tuple[Mode, ...] = ("static", "elastic")


@dataclass(frozen=True)
class Sample:
    """One server's state at one moment of the run."""

    t: float
    """Seconds since the common start (the engine's logical clock)."""
    served: int
    abandoned: int
    """Requests whose clients gave up before their first token, so far."""
    arrived: int
    waiting: int
    running: int
    held: int
    """Bytes of physical memory the pool holds (mapped plus pre-created pages)."""
    used: int
    """Bytes of mapped pages holding live or cached blocks."""
    lease: int
    """Bytes the pool's lease allows at this moment."""
    lease_peak: int
    """Highest lease since the previous sample (this one's included): the most the pool
    may have grown to in between."""
    preemptions: int
    reclaims: int
    """Times the lease was lowered so far (elastic only)."""

    def to_json(self) -> str:
        return json.dumps({"kind": "sample", **asdict(self)}, separators=(",", ":"))


@dataclass
class ServerResult:
    """What one server reports when its run ends."""

    mode: Mode
    model: int
    offered: int
    """Requests of this model in the trace."""
    arrived: int
    served: int
    abandoned: int
    """Requests whose clients gave up before their first token."""
    preemptions: int
    reclaims: int
    reclaimed_bytes: int
    waits_s: list[float]
    """Queueing delay of every arrived request (see the module doc)."""
    wait_arrivals_s: list[float]
    """Arrival time of each entry of ``waits_s``."""
    samples: list[Sample] = field(default_factory=list)
    world: str = ""
    """Which run it belongs to when a demo runs several elastic worlds (one per broker
    policy); empty means its mode's."""
    steps: int = 0
    """Engine steps during the replay (real servers: vLLM's ``vllm:iteration_tokens_total``
    count)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """Real servers: CPU seconds their processes spent during the replay, by role
    (:meth:`~kvshare.demo.serving.vllm_server.VllmServer.cpu_seconds`)."""

    def to_json(self) -> str:
        payload = asdict(self)
        del payload["samples"]  # sent one by one while running
        return json.dumps({"kind": "result", **payload}, separators=(",", ":"))

    @classmethod
    def from_message(cls, message: dict[str, Any], samples: list[Sample]) -> ServerResult:
        fields = {k: v for k, v in message.items() if k != "kind"}
        return cls(**fields, samples=samples)


def sample_from_message(message: dict[str, Any]) -> Sample:
    """A :class:`Sample` from its JSON object (``kind`` dropped)."""
    return Sample(**{k: v for k, v in message.items() if k != "kind"})


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile (0-100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class ModelSummary:
    """One model (or all of them, ``model is None``) in one mode."""

    mode: Mode
    model: int | None
    offered: int
    arrived: int
    served: int
    abandoned: int
    p50_wait_s: float
    p95_wait_s: float
    peak_kv: int
    """Highest lease, in bytes (for a total: of the sum of the leases)."""
    mean_kv: float
    mean_used: float
    preemptions: int
    reclaims: int


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def summarize(result: ServerResult) -> ModelSummary:
    """The per-model line of the summary."""
    leases = [s.lease for s in result.samples]
    return ModelSummary(
        mode=result.mode,
        model=result.model,
        offered=result.offered,
        arrived=result.arrived,
        served=result.served,
        abandoned=result.abandoned,
        p50_wait_s=percentile(result.waits_s, 50),
        p95_wait_s=percentile(result.waits_s, 95),
        peak_kv=max(leases, default=0),
        mean_kv=_mean(leases),
        mean_used=_mean(s.used for s in result.samples),
        preemptions=result.preemptions,
        reclaims=result.reclaims,
    )


def total_kv_series(results: Sequence[ServerResult]) -> list[tuple[float, int]]:
    """Sum of the servers' leases over time, on the first server's sample times.

    Each server's value at time ``t`` is its latest sample at or before ``t``.
    """
    if not results:
        return []
    series = []
    cursors = [0] * len(results)
    for sample in results[0].samples:
        total = 0
        for i, result in enumerate(results):
            while (
                cursors[i] + 1 < len(result.samples)
                and result.samples[cursors[i] + 1].t <= sample.t
            ):
                cursors[i] += 1
            if result.samples and result.samples[cursors[i]].t <= sample.t:
                total += result.samples[cursors[i]].lease
        series.append((sample.t, total))
    return series


def summarize_all(
    mode: Mode, results: Sequence[ServerResult], kv_series: Sequence[tuple[float, int]] = ()
) -> ModelSummary:
    """The total line of one mode: counts summed, delays pooled over every request.

    ``kv_series`` is the total KV memory over time when a better source than the servers'
    own samples exists (the broker's books, read at one instant); by default the servers'
    leases are added up at their common sample times.
    """
    mine = [r for r in results if r.mode == mode]
    waits = [w for r in mine for w in r.waits_s]
    totals = [kv for _, kv in (kv_series or total_kv_series(mine))]
    return ModelSummary(
        mode=mode,
        model=None,
        offered=sum(r.offered for r in mine),
        arrived=sum(r.arrived for r in mine),
        served=sum(r.served for r in mine),
        abandoned=sum(r.abandoned for r in mine),
        p50_wait_s=percentile(waits, 50),
        p95_wait_s=percentile(waits, 95),
        peak_kv=max(totals, default=0),
        mean_kv=_mean(totals),
        mean_used=sum(summarize(r).mean_used for r in mine),
        preemptions=sum(r.preemptions for r in mine),
        reclaims=sum(r.reclaims for r in mine),
    )


@dataclass(frozen=True)
class Comparison:
    """The two runs side by side."""

    per_model: list[ModelSummary]
    static: ModelSummary
    elastic: ModelSummary

    @property
    def ratio(self) -> float:
        """Requests served elastic / static (same trace, time and total memory)."""
        return self.elastic.served / self.static.served if self.static.served else math.inf


def compare(
    results: Sequence[ServerResult], elastic_kv: Sequence[tuple[float, int]] = ()
) -> Comparison:
    """Per-model and total summaries of both modes (``elastic_kv``: the broker's total)."""
    ordered = sorted(results, key=lambda r: (MODES.index(r.mode), r.model))
    return Comparison(
        per_model=[summarize(r) for r in ordered],
        static=summarize_all("static", results),
        elastic=summarize_all("elastic", results, elastic_kv),
    )


@dataclass(frozen=True)
class BookViolation:
    """A moment when memory was over-committed."""

    t: float
    what: str


def check_pool_books(results: Sequence[ServerResult]) -> list[BookViolation]:
    """Every sample where a pool grew beyond the highest lease it had since the last one.

    A pool may hold more than a lease that was just lowered (it shrinks lazily, as its
    blocks are freed, and the broker keeps that memory booked until the pool has given it
    back), but it must never *grow* beyond its lease.
    """
    violations = []
    for r in results:
        before = 0
        for s in r.samples:
            if s.held > before and s.held > s.lease_peak:
                violations.append(
                    BookViolation(
                        s.t,
                        f"{r.mode} model {r.model} grew to {s.held} bytes, over its lease "
                        f"(at most {s.lease_peak} since the previous sample)",
                    )
                )
            before = s.held
    return violations


def check_consistency(result: ServerResult) -> list[str]:
    """Ways the server's counts disagree with the trace (empty when they agree)."""
    problems = []
    if not result.served + result.abandoned <= result.arrived <= result.offered:
        problems.append(
            f"{result.mode} model {result.model}: served {result.served} + abandoned "
            f"{result.abandoned} <= arrived {result.arrived} <= offered {result.offered} "
            "does not hold"
        )
    if len(result.waits_s) != result.arrived:
        problems.append(
            f"{result.mode} model {result.model}: {len(result.waits_s)} queueing delays "
            f"for {result.arrived} arrived requests"
        )
    return problems
