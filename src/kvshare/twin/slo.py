"""Whether a run meets the workload's latency SLO, counted request by request.

Per request the twin records its time to first token (arrival to first token) and its
time per output token (``(last token - first token) / (output tokens - 1)``, 0 for a
single token). A request whose client gave up before its first token (the clients'
patience, :data:`PATIENCE_S`, exists only so that overloaded runs end) has neither, and
misses the SLO on both.

The SLO (:class:`~kvshare.twin.workload.Slo`) holds when, over all ``N`` requests, the
99th percentile of time to first token is at most its target, and so is that of time per
output token, and every model has at least ``min_attainment`` of its requests within
both targets. Percentiles are nearest-rank (the ``ceil(0.99 N)``-th smallest value), so
each part is a count: at most ``N - ceil(0.99 N)`` requests over the TTFT target, as many
over the TPOT target, and at most ``N_m - ceil(min_attainment N_m)`` of model ``m``'s
requests missing either.

Because each part is a count of misses, a run can be judged before it ends: once a part
has more misses than it allows, no later request can undo it, and :class:`SloMonitor`
stops the clock. A request still waiting for its first token longer than the TTFT target
already misses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.demo.engine_api import EngineRequest
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.sim_node import SimClock
from kvshare.twin.workload import Slo

__all__ = [
    "CHECK_EVERY_S",
    "PATIENCE_S",
    "RequestRecord",
    "SloMonitor",
    "SloVerdict",
    "allowed_misses",
    "judge",
]

#: Seconds a client waits for its first token before it gives up.
PATIENCE_S = 60.0
#: Simulated seconds between two looks at the queues for requests already over target.
CHECK_EVERY_S = 0.5


def allowed_misses(count: int, share: float) -> int:
    """How many of ``count`` values may exceed a target while the ``share`` quantile
    (nearest rank) stays within it."""
    return count - math.ceil(share * count - 1e-9)


@dataclass(frozen=True)
class RequestRecord:
    """What one request got: its model, and its TTFT and TPOT in seconds (None: it gave
    up before its first token); when it arrived, and when its last token came (None: it
    gave up, or it was never judged)."""

    model: int
    ttft_s: float | None
    tpot_s: float | None
    arrival_s: float = 0.0
    last_token_s: float | None = None


@dataclass(frozen=True)
class SloVerdict:
    """A run's result against the SLO."""

    met: bool
    requests: int
    ttft_p99_s: float
    tpot_p99_s: float
    #: Per model, the share of its requests within both targets.
    attainment: tuple[float, ...]
    gave_up: int
    #: The run stopped as soon as the SLO was certainly missed (its percentiles then
    #: count only the requests judged by then).
    stopped_early: bool = False


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values.sort()
    return values[max(0, math.ceil(0.99 * len(values) - 1e-9) - 1)]


def judge(
    slo: Slo,
    records: Sequence[RequestRecord],
    per_model: Sequence[int],
    *,
    stopped_early: bool = False,
) -> SloVerdict:
    """The verdict on a run's ``records`` (one per request of the workload, or those
    judged before a run ``stopped_early``; ``per_model[m]`` requests of model ``m``)."""
    count = sum(per_model)
    if len(records) > count:
        raise ValueError(f"{len(records)} records for a workload of {count} requests")
    ttft_over = sum(1 for r in records if r.ttft_s is None or r.ttft_s > slo.ttft_p99_s)
    limit_tpot = slo.tpot_p99_ms / 1000
    tpot_over = sum(1 for r in records if r.tpot_s is None or r.tpot_s > limit_tpot)
    missed = [0] * len(per_model)
    for record in records:
        if _misses(slo, record):
            missed[record.model] += 1
    attainment = tuple(
        1.0 - missed[m] / per_model[m] if per_model[m] else 1.0 for m in range(len(per_model))
    )
    met = (
        not stopped_early
        and ttft_over <= allowed_misses(count, 0.99)
        and tpot_over <= allowed_misses(count, 0.99)
        and all(
            missed[m] <= allowed_misses(per_model[m], slo.min_attainment)
            for m in range(len(per_model))
        )
    )
    return SloVerdict(
        met=met,
        requests=count,
        # The percentiles of the requests judged (all of them unless stopped early).
        ttft_p99_s=_p99([math.inf if r.ttft_s is None else r.ttft_s for r in records]),
        tpot_p99_s=_p99([math.inf if r.tpot_s is None else r.tpot_s for r in records]),
        attainment=attainment,
        gave_up=sum(1 for r in records if r.ttft_s is None),
        stopped_early=stopped_early,
    )


def _misses(slo: Slo, record: RequestRecord) -> bool:
    return (
        record.ttft_s is None
        or record.tpot_s is None
        or record.ttft_s > slo.ttft_p99_s
        or record.tpot_s > slo.tpot_p99_ms / 1000
    )


class SloMonitor:
    """Records every request's fate as the engines report it (the engines'
    :class:`~kvshare.demo.engine_api.RequestObserver`), and stops the clock once every
    request is judged or the SLO is certainly missed."""

    def __init__(
        self, slo: Slo, model_of: Sequence[int], models: int, *, judge_early: bool = True
    ) -> None:
        """``model_of[rid]`` is the model of request ``rid`` (requests are numbered from
        0); ``models`` how many models the workload has. ``judge_early=False`` lets the
        run go on to its end even once the SLO is missed, so that every request's
        attainment is counted (for curves of attainment against load)."""
        self.slo = slo
        self.judge_early = judge_early
        self._clock = SimClock()
        self._model_of = model_of
        counts = [0] * models
        for model in model_of:
            counts[model] += 1
        self.per_model = tuple(counts)
        self.total = len(model_of)
        self.records: list[RequestRecord] = []
        self._judged = [0] * models
        self._first: dict[int, float] = {}
        self._ttft_over = 0
        self._tpot_over = 0
        self._missed = [0] * models
        self._engines: list[tuple[EngineSim, int]] = []
        self.failed = False

    def watch(self, clock: SimClock, engines: Sequence[EngineSim]) -> None:
        """Judge the run on ``clock`` (stopping it when judged), and look at ``engines``
        (engine ``m`` serves model ``m``) every :data:`CHECK_EVERY_S` for requests whose
        wait has already passed the TTFT target."""
        self._clock = clock
        self._engines = list(zip(engines, range(len(engines)), strict=True))
        if self.judge_early:
            self._clock.at(self._clock.now + CHECK_EVERY_S, self._check)

    # --- the engines' observer ----------------------------------------------------------
    def first_token(self, request: EngineRequest, at_s: float) -> None:
        self._first[request.rid] = at_s - request.arrival_s

    def finished(self, request: EngineRequest, first_token_s: float, last_token_s: float) -> None:
        outputs = request.output_tokens
        tpot = (last_token_s - first_token_s) / (outputs - 1) if outputs > 1 else 0.0
        ttft = self._first.pop(request.rid, first_token_s - request.arrival_s)
        self._record(request, ttft, tpot, last_token_s)

    def gave_up(self, request: EngineRequest, at_s: float) -> None:
        self._first.pop(request.rid, None)
        self._record(request, None, None, None)

    def _record(
        self,
        request: EngineRequest,
        ttft: float | None,
        tpot: float | None,
        last_token_s: float | None,
    ) -> None:
        model = self._model_of[request.rid]
        record = RequestRecord(model, ttft, tpot, request.arrival_s, last_token_s)
        self.records.append(record)
        self._judged[model] += 1
        if ttft is None or ttft > self.slo.ttft_p99_s:
            self._ttft_over += 1
        if tpot is None or tpot > self.slo.tpot_p99_ms / 1000:
            self._tpot_over += 1
        if _misses(self.slo, record):
            self._missed[model] += 1
        if len(self.records) == self.total:
            self._clock.stopped = True
        elif self.judge_early and self._certainly_missed(0, [0] * len(self.per_model)):
            self.failed = self._clock.stopped = True

    # --- judging early ----------------------------------------------------------------------
    def _certainly_missed(self, waiting_over: int, waiting_by_model: list[int]) -> bool:
        """Whether the SLO is missed whatever comes next, counting ``waiting_over``
        requests still waiting past the TTFT target (``waiting_by_model`` of each model):
        they miss the TTFT part and their model's attainment, not yet the TPOT part (their
        tokens may still come fast)."""
        limit = allowed_misses(self.total, 0.99)
        if self._ttft_over + waiting_over > limit or self._tpot_over > limit:
            return True
        return any(
            self._missed[m] + waiting_by_model[m] > allowed_misses(n, self.slo.min_attainment)
            for m, n in enumerate(self.per_model)
        )

    def _check(self) -> None:
        cutoff = self._clock.now - self.slo.ttft_p99_s
        by_model = [0] * len(self.per_model)
        for engine, model in self._engines:
            by_model[model] += engine.overdue(cutoff)
        if self._certainly_missed(sum(by_model), by_model):
            self.failed = self._clock.stopped = True
            return
        self._clock.at(self._clock.now + CHECK_EVERY_S, self._check)

    def verdict(self) -> SloVerdict:
        """The run's verdict (requests never judged count as given up)."""
        records = list(self.records)
        if not self.failed:
            for model, count in enumerate(self.per_model):
                records += [RequestRecord(model, None, None)] * (count - self._judged[model])
        return judge(self.slo, records, self.per_model, stopped_early=self.failed)
