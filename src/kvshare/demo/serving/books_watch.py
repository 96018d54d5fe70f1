"""The node agent's books and the servers' memory, sampled while a scenario runs.

:class:`BooksWatch` reads the books from the agent's admin socket every ``interval_s``
(``None`` while the agent does not answer: stopped, frozen, restarting) and, at the same
moment, what each server's processes really hold in KV memory (their memfds on the host
backend, read from ``/proc``, as the agent's audit reads them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.deviceplugin.broker.audit import memfd_bytes_of
from kvshare.deviceplugin.broker.views import BooksView

__all__ = ["BooksWatch", "Sample"]


@dataclass(frozen=True)
class Sample:
    """One reading."""

    at: float
    """Monotonic seconds when the books were asked for: the view is no older, so a check
    of what held from some moment on counts only views asked for after it (the memory
    readings come right after the view, which on loaded cores can take seconds)."""
    view: BooksView | None
    """The books (``None``: the agent did not answer within the interval)."""
    held: Mapping[str, int]
    """Server name -> KV bytes its processes hold."""


class BooksWatch:
    """Samples the books and the servers' memory on a thread (see the module doc).

    ``trees`` maps a server's name to a function giving its live processes."""

    def __init__(
        self,
        agent: NodeAgentProcess,
        trees: Mapping[str, Callable[[], Sequence[int]]],
        interval_s: float = 0.25,
    ) -> None:
        self._agent = agent
        self._trees = dict(trees)
        self._interval = interval_s
        self._lock = threading.Lock()  # guards samples
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> BooksWatch:
        self._thread = threading.Thread(target=self._run, name="books-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self.between(0.0, float("inf"))

    def sample(self) -> Sample:
        """One reading now."""
        asked = time.monotonic()
        view = self._agent.try_view(timeout_s=self._interval)
        held = {name: memfd_bytes_of(tree()) or 0 for name, tree in self._trees.items()}
        return Sample(asked, view, held)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            reading = self.sample()
            with self._lock:
                self.samples.append(reading)
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def between(self, start: float, end: float) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if start <= s.at <= end]
