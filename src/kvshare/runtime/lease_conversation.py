"""What a pool says to the node agent's broker, and when: the broker client's state,
without its socket.

:class:`~kvshare.runtime.broker_client.BrokerLease` carries these messages over the
broker's unix socket; the demo's simulated node (:mod:`kvshare.demo.elastic_sim`) carries
them in simulated time. Either way the pool asks and reports by the same rules:

- growth is asked in chunks (a multiple of the page size), so the allocation path rarely
  waits for a round trip;
- a pool still short of what it asked says so again when it asks again after
  ``REFRESH_S`` (the pool's own retries are half a second apart): the broker can tell an ask
  that still stands from one the pool no longer needs;
- a pool that keeps running out asks for geometrically more (slow start): when it wants
  more than it asked for while still waiting for that, or within ``slow_start_window_s``
  of being granted all of it, the step above its lease doubles (one chunk, two, four,
  ..., never more than the lease itself, so the lease at most doubles per round trip).
  The step starts again at one chunk after a quiet spell or a reclaim. What it asks is
  capped at its ``ceiling`` (its capacity; the broker caps at the ``kv_max`` in force);
- reports are sent at most every ``report_interval_s``, except those made once a
  reclaim's lower limit is in force: they carry the reclaim's ``seq`` (never an older
  one: the pool may have grown since) and go at once, since they hand memory on. The
  first whose held bytes fit the limit completes the reclaim. A usage that states the
  limit it was taken under (:attr:`PoolUsage.limit`) counts only if that limit is the
  lowered one.

Not thread-safe: the caller serialises every call (``BrokerLease._lock``). Times are the
caller's monotonic seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.api.wire import Reclaim, Report, Want
from kvshare.runtime.lease import PoolUsage

__all__ = ["LeaseConversation"]

#: How long the lease thread may sleep when nothing is due.
IDLE_S = 0.5
#: The least time between two asks for the same amount.
REFRESH_S = 0.25


@dataclass
class _PendingAck:
    seq: int
    limit: int
    reports_at_change: int = 0
    """Reports made before the lower limit was in force do not acknowledge."""


class LeaseConversation:
    """One pool's side of its lease conversation (see the module doc)."""

    def __init__(
        self,
        *,
        chunk_bytes: int,
        page_size: int,
        ceiling: int | None,
        report_interval_s: float,
        slow_start_window_s: float,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page size must be > 0, not {page_size}")
        self.chunk = -(-chunk_bytes // page_size) * page_size
        self.ceiling = ceiling
        self.report_interval_s = report_interval_s
        self.slow_start_window_s = slow_start_window_s
        self.limit = 0
        """The lease in bytes, as last granted or reclaimed."""
        self.usage: PoolUsage | None = None
        """The pool's latest report."""
        self._asked = 0
        self._asked_at = 0.0
        self._refresh = False
        self._step = self.chunk
        self._satisfied_at: float | None = None  # when the lease last reached _asked
        self._reports = 0
        self._pending: _PendingAck | None = None
        self._seq = 0
        self._sent_want = 0
        self._sent_reports = 0
        self._last_report_at = 0.0

    # --- what the pool says ----------------------------------------------------------------

    def want(self, total_bytes: int, now: float) -> bool:
        """The pool wants its lease to reach ``total_bytes``: ask for that, rounded up to
        whole chunks and to at least the lease plus the growth step, capped at ``ceiling``.
        Whether a :meth:`next_want` is due: the wish grew, or still stands unmet and was
        last said ``REFRESH_S`` ago."""
        if total_bytes <= self.limit:
            return False
        if total_bytes <= self._asked:
            if now - self._asked_at < REFRESH_S:
                return False
            self._asked_at = now
            self._refresh = True
            return True
        self._grow_step(now)
        target = max(total_bytes, self.limit + self._step)
        target = -(-target // self.chunk) * self.chunk
        if self.ceiling is not None:
            target = min(target, self.ceiling)
        if target <= max(self.limit, self._asked):
            return False
        self._asked, self._asked_at = target, now
        return True

    def _grow_step(self, now: float) -> None:
        """The pool wants more than it asked for so far: double the growth step if it is
        still waiting for that or got it within the slow-start window; start again at one
        chunk after a quiet spell."""
        satisfied = self._satisfied_at
        waiting = self._asked > self.limit
        if waiting or (satisfied is not None and now - satisfied <= self.slow_start_window_s):
            # At most doubling the lease per round: the step never outgrows it.
            self._step = min(self._step * 2, max(self.chunk, self.limit))
        elif satisfied is not None:
            self._step = self.chunk
        self._satisfied_at = None

    def report(self, usage: PoolUsage) -> None:
        """Record what the pool holds; :meth:`next_report` says when it goes."""
        self.usage = usage
        self._reports += 1

    # --- what goes to the broker -------------------------------------------------------------

    def next_want(self) -> Want | None:
        """The wish to send now: what the pool asks, when that grew past what was sent or
        is said again."""
        refresh, self._refresh = self._refresh, False
        if self._asked <= self.limit or (self._asked <= self._sent_want and not refresh):
            return None
        self._seq += 1
        self._sent_want = self._asked
        return Want(seq=self._seq, total=self._asked)

    def next_report(self, now: float) -> tuple[Report | None, float]:
        """The report to send now, if one is due; and how long the caller may wait before
        asking again (a rate-limited report falls due)."""
        usage, pending = self.usage, self._pending
        if usage is None or self._reports == self._sent_reports:
            return None, IDLE_S
        in_force = (
            pending is not None
            and self._reports > pending.reports_at_change
            and (usage.limit is None or usage.limit <= pending.limit)
        )
        ack = pending.seq if pending is not None and in_force else 0
        wait = self._last_report_at + self.report_interval_s - now
        if not ack and wait > 0:
            return None, wait  # reports under a reclaim go at once: they hand memory on
        report = Report(
            mapped=usage.mapped,
            used=usage.used,
            cached=usage.cached,
            reserved=usage.reserved,
            ack=ack,
            page_bytes=usage.page_bytes,
            layout=usage.layout,
            layout_reason=usage.layout_reason,
        )
        self._sent_reports = self._reports
        self._last_report_at = now
        if ack and pending is not None and usage.held <= pending.limit:
            self._pending = None  # this report completes the reclaim
        return report, IDLE_S

    # --- what the broker says ----------------------------------------------------------------

    def granted(self, limit: int, now: float) -> bool:
        """A :class:`~kvshare.api.wire.Lease` (or a welcome) set the lease; whether it
        changed."""
        changed = limit != self.limit
        self.limit = limit
        if changed and 0 < self._asked <= limit:
            self._satisfied_at = now
        return changed

    def reclaimed(self, reclaim: Reclaim) -> None:
        """The broker lowered the lease: reports from here on are made with the lower limit
        in force (a pool that shrinks and reports at once acknowledges at once)."""
        self.limit = reclaim.limit
        self._asked = min(self._asked, reclaim.limit)
        # Contention: growth starts again at one chunk.
        self._step, self._satisfied_at = self.chunk, None
        self._pending = _PendingAck(reclaim.seq, reclaim.limit, self._reports)
        self._sent_want = min(self._sent_want, reclaim.limit)

    # --- the connection ----------------------------------------------------------------------

    def connected(self) -> None:
        """A new connection: nothing has been said on it yet."""
        self._sent_want = 0
        self._sent_reports = 0

    def disconnected(self) -> None:
        """The connection dropped: a new broker re-declares from what the pool holds."""
        self._pending = None
