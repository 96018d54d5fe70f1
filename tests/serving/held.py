"""Requests a test keeps running on a real server for as long as it needs them.

:class:`KeepRunning` keeps ``count`` greedy requests in flight on a server: long ones (up
to the model's length), each replaced as soon as it ends, until the test closes the gate;
closing the connections makes vLLM abort them. Their answers are not streamed: the
threads that hold them wait in the kernel, and the test's own process stays as quick to
talk to the agent as any other client. While the gate is open the
server runs them (its own ``vllm:num_requests_running`` says so), so a moment the test
needs ("while the server serves") does not depend on how fast the machine decodes.
Their tokens are not checked (they are cut short); the requests a test measures are
others, sent beside them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from types import TracebackType

from kvshare.demo.serving.vllm_server import MODEL_NAME, VllmServer
from tests.serving.conftest import token_prompt

#: Prompt and output of a held request: as long as the tiny model's 2048 positions allow.
PROMPT_TOKENS = 64
MAX_TOKENS = 1900


class KeepRunning:
    """``count`` requests kept in flight on ``server`` until :meth:`close`."""

    def __init__(self, server: VllmServer, count: int, seed: int = 900) -> None:
        self._url = urllib.parse.urlsplit(server.url)
        self._count = count
        self._seed = seed
        self._closing = threading.Event()
        self._lock = threading.Lock()  # guards _connections
        self._connections: set[http.client.HTTPConnection] = set()
        self._threads = [
            threading.Thread(target=self._hold, args=(i,), daemon=True) for i in range(count)
        ]

    def __enter__(self) -> KeepRunning:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Abort the held requests (vLLM aborts a request whose client has gone)."""
        self._closing.set()
        with self._lock:
            for connection in self._connections:
                if connection.sock is not None:
                    with contextlib.suppress(OSError):
                        connection.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(30)

    def _hold(self, slot: int) -> None:
        round_ = 0
        while not self._closing.is_set():
            round_ += 1
            prompt = token_prompt(self._seed + 1000 * slot + round_, PROMPT_TOKENS)
            self._one(list(prompt))

    def _one(self, prompt: list[int]) -> None:
        connection = http.client.HTTPConnection(self._url.hostname, self._url.port, timeout=600)
        with self._lock:
            if self._closing.is_set():
                return
            self._connections.add(connection)
        try:
            body = {
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True,
            }  # fmt: skip
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            connection.getresponse().read()
        except (OSError, http.client.HTTPException):
            pass  # closed by close(), or the server went away
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()
