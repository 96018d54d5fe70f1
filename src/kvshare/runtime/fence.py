"""Fences: a freed page is unmapped only after the device work that could read it is done.

``cuMemUnmap`` is not ordered with the GPU's streams. Engines free the blocks of finished
requests while the next step — which may still read them — is running (vLLM's
asynchronous scheduling, SGLang's overlap scheduler), so unmapping a page the moment it
empties could fault an in-flight kernel. Two fences, neither on the allocation path:

- **Device fence** (every backend, every rank, :meth:`Backend.record_fence` and
  :meth:`Backend.wait_fence`): the engine hooks mark the work they have launched after
  each step, on the streams it runs on (a CUDA event per stream); a page space waits for
  the latest mark before every unmap. This is enough where the engine launches a step
  before it frees the blocks of the previous one (SGLang: one scheduler per rank, in the
  process that runs the step).
- **Step fence** (the deciding pool, :class:`StepFence`): where the process that frees
  blocks is not the one that launches the work (vLLM: the scheduler decides, its workers
  run the steps, possibly later than the scheduler frees), a page picked for unmapping
  while steps up to *N* were scheduled waits until step *N*'s output is back. Then every
  rank has launched step *N*, and its own device fence covers the rest.

:class:`HostStream` gives the ``host`` backend in-flight work of its own: callables run in
order on one thread, like kernels on a stream, so the device fence is real and testable
without a GPU. Engines on a CPU compute synchronously and launch nothing on it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["HostStream", "StepFence"]

log = logging.getLogger(__name__)


class StepFence:
    """Steps an engine's scheduler has handed out, and steps whose output is back.

    Only the engine's scheduler thread calls :meth:`scheduled` and :meth:`finished` (one
    writer per counter); any thread may read. A pool with no engine steps (none hooked)
    is always past its fence.
    """

    def __init__(self) -> None:
        self._scheduled = 0
        self._finished = 0
        self._on_finished: Callable[[], None] | None = None

    def watch(self, on_finished: Callable[[], None]) -> None:
        """Call ``on_finished`` (cheap, any thread) after each finished step."""
        self._on_finished = on_finished

    def scheduled(self) -> None:
        """The scheduler is handing out one more step (called before it decides it)."""
        self._scheduled += 1

    def finished(self) -> None:
        """One step's output is back: its device work is done."""
        self._finished += 1
        callback = self._on_finished
        if callback is not None:
            callback()

    def stamp(self) -> int:
        """The step a page emptied now may still be read by."""
        return self._scheduled

    def passed(self, stamp: int) -> bool:
        """Whether every step up to ``stamp`` has finished."""
        return self._finished >= stamp


class HostStream:
    """In-order work on the host "device": the ``host`` backend's stream.

    :meth:`launch` queues a callable and returns at once; one thread runs the queue in
    order. :meth:`mark` and :meth:`wait` are a CUDA event's record and synchronize: a
    wait returns once everything launched before the mark has run. Threads: ``_cond``
    guards the queue and both counters.
    """

    def __init__(self, name: str = "kvshare-host-stream") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], object]] = deque()
        self._launched = 0
        self._done = 0
        self._mark = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def launch(self, work: Callable[[], object]) -> None:
        """Queue ``work`` behind everything launched before it."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the host stream is closed")
            self._queue.append(work)
            self._launched += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def mark(self) -> None:
        """Record the work launched so far (an event recorded on the stream)."""
        with self._cond:
            self._mark = self._launched

    def wait(self) -> None:
        """Block until the work launched before the latest :meth:`mark` has run."""
        with self._cond:
            self._cond.wait_for(lambda: self._done >= self._mark or self._closed)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                work = self._queue.popleft()
            try:
                work()
            except Exception:
                log.exception("work launched on the host stream failed")
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def close(self) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._cond.wait_for(lambda: not self._queue)
            self._closed = True
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
