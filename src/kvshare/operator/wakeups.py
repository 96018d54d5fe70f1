"""Reconciles due later: the end of a failed replica's back-off (:mod:`.backoff`), when a
held-back replica may be replaced. Nothing else may happen to the ModelServer until then,
so no watch event would bring that run; a timer on the event loop does. Touched on the
event loop's thread only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from kvshare.operator.views import ModelServerKey

__all__ = ["WakeUps"]


class WakeUps:
    """One timer per ModelServer; when it fires, ``request`` reconciles the ModelServer."""

    def __init__(self, request: Callable[[ModelServerKey], Coroutine[Any, Any, None]]) -> None:
        self._request = request
        self._timers: dict[ModelServerKey, asyncio.TimerHandle] = {}
        self._woken: set[asyncio.Task[None]] = set()

    def later(self, key: ModelServerKey, delay: float | None) -> None:
        """Reconcile ``key`` again in ``delay`` seconds (``None``: not on a timer)."""
        handle = self._timers.pop(key, None)
        if handle is not None:
            handle.cancel()
        if delay is not None:
            # A little late rather than early: the run must find the delay passed.
            self._timers[key] = asyncio.get_running_loop().call_later(delay + 0.05, self._wake, key)

    def close(self) -> None:
        """The operator stops: drop the reconciles due later."""
        for key in list(self._timers):
            self.later(key, None)
        for task in list(self._woken):
            task.cancel()

    def _wake(self, key: ModelServerKey) -> None:
        self._timers.pop(key, None)
        task = asyncio.ensure_future(self._request(key))
        self._woken.add(task)
        task.add_done_callback(self._woken.discard)
