"""A client of one ``vllm serve``: its OpenAI completions API and its Prometheus metrics.

Only what a user's client does: HTTP requests to ``/v1/completions`` (greedy, with the
token ids vLLM returns on request), streamed when the time to the first token matters, and
scrapes of ``/metrics``. Standard library only (plus ``prometheus_client``'s parser for
the metrics text).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.demo.serving.vllm_server import MODEL_NAME

__all__ = [
    "Completion",
    "CompletionError",
    "MetricSample",
    "StreamedCompletion",
    "complete",
    "labels_of",
    "post",
    "scrape",
    "stream_complete",
    "total",
]


class CompletionError(RuntimeError):
    """The server answered a request with an error status; ``status`` holds it."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(frozen=True)
class Completion:
    """One finished greedy completion."""

    status: int
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    text: str
    finish_reason: str


def _body(
    prompt: str | Sequence[int], max_tokens: int, *, ignore_eos: bool, stream: bool
) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
        "stream": stream,
    }


def post(
    url: str, path: str, payload: dict[str, Any] | None = None, timeout_s: float = 600.0
) -> Any:
    """POST JSON to ``url + path``; the decoded JSON answer (``None`` for an empty one)."""
    data = json.dumps(payload or {}).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise CompletionError(exc.code, exc.read().decode(errors="replace")) from None
    return json.loads(body) if body.strip() else None


def complete(
    url: str,
    prompt: str | Sequence[int],
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    timeout_s: float = 600.0,
) -> Completion:
    """One greedy completion; :class:`CompletionError` on an error status."""
    answer = post(
        url, "/v1/completions", _body(prompt, max_tokens, ignore_eos=ignore_eos, stream=False),
        timeout_s,
    )  # fmt: skip
    choice = answer["choices"][0]
    return Completion(
        status=200,
        token_ids=tuple(choice["token_ids"]),
        prompt_token_ids=tuple(choice.get("prompt_token_ids") or ()),
        text=choice["text"],
        finish_reason=str(choice.get("finish_reason")),
    )


@dataclass(frozen=True)
class StreamedCompletion:
    """A streamed completion as its client saw it: when tokens came, or that it gave up."""

    status: int
    token_ids: tuple[int, ...]
    ttft_s: float | None
    """Seconds from sending to the first generated token (``None``: no token came)."""
    total_s: float
    abandoned: bool
    """The client gave up before a first token (``patience_s``) and closed the connection."""


def stream_complete(
    url: str,
    prompt: str | Sequence[int],
    max_tokens: int,
    *,
    patience_s: float | None = None,
    ignore_eos: bool = True,
    timeout_s: float = 600.0,
) -> StreamedCompletion:
    """A streamed greedy completion. With ``patience_s``, the client closes the connection
    if no token has come by then (vLLM aborts a request whose client has gone)."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(
        parsed.hostname or "127.0.0.1", parsed.port, timeout=patience_s or timeout_s
    )
    started = time.monotonic()
    tokens: list[int] = []
    ttft: float | None = None
    try:
        body = json.dumps(_body(prompt, max_tokens, ignore_eos=ignore_eos, stream=True))
        connection.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise CompletionError(response.status, response.read().decode(errors="replace"))
        while True:
            if ttft is None and patience_s is not None and connection.sock is not None:
                # Whatever comes before the first token, the patience runs from the send.
                left = started + patience_s - time.monotonic()
                connection.sock.settimeout(max(0.001, left))
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            for choice in json.loads(data).get("choices", ()):
                ids = choice.get("token_ids") or ()
                if ids and ttft is None:
                    ttft = time.monotonic() - started
                    if connection.sock is not None:
                        connection.sock.settimeout(timeout_s)
                tokens.extend(ids)
    except TimeoutError:
        if ttft is not None or patience_s is None:
            raise
        # The client gives up: closing the connection makes vLLM abort the request.
        return StreamedCompletion(200, (), None, time.monotonic() - started, True)
    finally:
        connection.close()
    return StreamedCompletion(200, tuple(tokens), ttft, time.monotonic() - started, False)


@dataclass(frozen=True)
class MetricSample:
    """One sample of a Prometheus text page."""

    name: str
    labels: dict[str, str]
    value: float


def scrape(url: str, timeout_s: float = 5.0) -> list[MetricSample]:
    """Every sample of the Prometheus page at ``url`` (``/metrics`` of a server or agent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return [
        MetricSample(sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples: Sequence[MetricSample], name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def labels_of(samples: Sequence[MetricSample], name: str) -> dict[str, str]:
    """The labels of the first sample named ``name`` (an ``_info`` metric), or ``{}``."""
    return next((s.labels for s in samples if s.name == name), {})
