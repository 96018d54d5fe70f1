"""Log lines about what peers do, at a bounded rate.

A hostile or broken neighbour can open thousands of bad connections a second; logging
each would fill the node's disk and drown every other line. :class:`ThrottledLog` lets
``burst`` lines through per ``interval_s`` and counts the rest; the count is logged once
the interval is over, so nothing goes unreported (the metrics count every event).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ThrottledLog"]


class ThrottledLog:
    """At most ``burst`` lines per ``interval_s`` for one kind of event, plus one line
    saying how many more there were. Not thread-safe: one thread logs through it."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        burst: int = 10,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._burst = burst
        self._interval_s = interval_s
        self._clock = clock
        self._window_start = -interval_s
        self._logged = 0
        self._suppressed = 0

    def log(self, level: int, message: str, *args: object, exc_info: bool = False) -> None:
        """Log ``message`` unless this interval's lines are spent; count it then."""
        self.flush()
        if self._logged >= self._burst:
            self._suppressed += 1
            return
        self._logged += 1
        self._logger.log(level, message, *args, exc_info=exc_info)

    def flush(self) -> None:
        """Start a new interval if the current one is over, reporting what it suppressed.
        Call it now and then (the broker does on every tick) so a burst's count is
        logged even when no further event comes."""
        now = self._clock()
        if now - self._window_start < self._interval_s:
            return
        if self._suppressed:
            self._logger.warning(
                "%d more %s in the last %.0f s not logged",
                self._suppressed,
                self._what,
                now - self._window_start,
            )
        self._window_start = now
        self._logged = 0
        self._suppressed = 0
