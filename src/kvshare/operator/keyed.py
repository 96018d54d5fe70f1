"""Run one piece of work per key at a time, coalescing requests and retrying failures.

Events for a ModelServer arrive from several kopf handlers at once (its own, each of its
pods', each KVShareNode's). :class:`KeyedRunner` guarantees that at most one reconcile
of a ModelServer runs at a time, and that a request arriving while one runs is not lost
but folded into one more run after it. A run that raises is retried after growing
delays; when they are used up the failure is reported and the next request starts over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["KeyedRunner"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class KeyedRunner(Generic[K]):
    """Serialized, coalesced, retried runs of ``work(key)``.

    All methods run on the event loop's thread; ``_dirty`` needs no lock there.
    """

    def __init__(
        self,
        work: Callable[[K], Awaitable[None]],
        give_up: Callable[[K, Exception], Awaitable[None]],
        retry_delays: Sequence[float],
    ) -> None:
        self._work = work
        self._give_up = give_up
        self._delays = tuple(retry_delays)
        # key -> "run once more": present while a run of that key is in progress.
        self._dirty: dict[K, bool] = {}

    def busy(self, key: K) -> bool:
        """Whether a run of ``key`` is in progress."""
        return key in self._dirty

    async def request(self, key: K) -> None:
        """Run ``work(key)`` now, or once more after the run in progress.

        Returns when this caller's run (and any folded into it) finished; a caller whose
        request was folded into a run in progress returns at once.
        """
        if key in self._dirty:
            self._dirty[key] = True
            return
        self._dirty[key] = False
        try:
            await self._run(key)
        finally:
            del self._dirty[key]

    async def _run(self, key: K) -> None:
        failures = 0
        while True:
            self._dirty[key] = False
            try:
                await self._work(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if failures >= len(self._delays):
                    log.error("giving up on %s after %d attempts: %s", key, failures + 1, exc)
                    await self._give_up(key, exc)
                    return
                delay = self._delays[failures]
                failures += 1
                log.warning("reconciling %s failed (%s); retrying in %.1fs", key, exc, delay)
                await asyncio.sleep(delay)
                continue
            failures = 0
            if not self._dirty[key]:
                return
