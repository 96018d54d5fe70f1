"""A steady stream of requests to real servers, each one checked against plain vLLM.

:class:`SteadyLoad` keeps ``clients`` requests in flight on each server (each client sends
its next request as soon as its last one answered), cycling through a fixed list of
greedy requests whose tokens plain vLLM gave (the *reference*). Every answer is recorded
with when it was sent and when it came back; :meth:`SteadyLoad.problems` lists every
request that failed, came back short, or whose tokens differ from the reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshare.demo.serving.client import CompletionError, complete

__all__ = ["Answer", "Request", "SteadyLoad"]


@dataclass(frozen=True)
class Request:
    """One greedy request: token ids and how many tokens to generate (EOS ignored)."""

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Answer:
    """How one request went."""

    server: str
    request: Request
    sent_at: float
    """Monotonic seconds."""
    answered_at: float
    status: int
    tokens: tuple[int, ...]
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.answered_at - self.sent_at


class SteadyLoad:
    """``clients`` requests in flight per server until :meth:`stop` (see the module doc).

    ``servers`` maps a server's name to its URL; ``reference`` maps each request's prompt
    to plain vLLM's tokens for it.
    """

    def __init__(
        self,
        servers: Mapping[str, str],
        requests: Sequence[Request],
        reference: Mapping[tuple[int, ...], tuple[int, ...]],
        *,
        clients: int = 2,
        timeout_s: float = 300.0,
    ) -> None:
        self._servers = dict(servers)
        self._requests = list(requests)
        self._reference = reference
        self._clients = clients
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # guards answers and _next
        self.answers: list[Answer] = []
        self._next = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SteadyLoad:
        for name, url in self._servers.items():
            for client in range(self._clients):
                thread = threading.Thread(
                    target=self._run, args=(name, url), name=f"load-{name}-{client}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self) -> list[Answer]:
        """Send no more requests, wait for those in flight; every answer so far."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self._timeout_s)
        return list(self.answers)

    def _take(self) -> Request:
        with self._lock:
            request = self._requests[self._next % len(self._requests)]
            self._next += 1
            return request

    def _run(self, name: str, url: str) -> None:
        while not self._stop.is_set():
            answer = self.one(name, url, self._take())
            with self._lock:
                self.answers.append(answer)

    def one(self, name: str, url: str, request: Request) -> Answer:
        """Send ``request`` to server ``name`` at ``url``; how it went."""
        sent = time.monotonic()
        try:
            done = complete(url, request.prompt, request.max_tokens, timeout_s=self._timeout_s)
            return Answer(name, request, sent, time.monotonic(), 200, done.token_ids)
        except CompletionError as exc:
            return Answer(name, request, sent, time.monotonic(), exc.status, (), str(exc))
        except OSError as exc:
            return Answer(name, request, sent, time.monotonic(), 0, (), repr(exc))

    def answered_between(self, start: float, end: float) -> list[Answer]:
        """Answers to requests that were in flight at some moment of ``[start, end]``."""
        with self._lock:
            return [a for a in self.answers if a.sent_at <= end and a.answered_at >= start]

    def problems(self, answers: Sequence[Answer] | None = None) -> list[str]:
        """Every failed, short or wrong answer (of ``answers``, default all), described."""
        found = []
        for answer in self.answers if answers is None else answers:
            request = answer.request
            if answer.status != 200:
                found.append(f"{answer.server}: HTTP {answer.status} {answer.error[:200]}")
            elif len(answer.tokens) != request.max_tokens:
                found.append(
                    f"{answer.server}: {len(answer.tokens)} tokens of {request.max_tokens}"
                )
            elif answer.tokens != self._reference[request.prompt]:
                found.append(f"{answer.server}: tokens differ from plain vLLM's")
        return found
