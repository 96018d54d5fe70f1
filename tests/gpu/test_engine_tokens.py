"""End to end on a GPU: each engine gives the same greedy tokens with kvshare on and off.

Run where a CUDA GPU, the engine packages and a small model are present:

    KVSHARE_E2E_MODEL=Qwen/Qwen2.5-0.5B-Instruct python -m pytest -m gpu \\
        tests/gpu/test_engine_tokens.py

Each engine is started twice through its own server entry point, once plainly and once
with the runtime bundle (built as the image builds it) on ``PYTHONPATH`` and
``KVSHARE_ENABLE=1`` (standalone: a fixed lease, no node agent), with the same greedy
requests sent to both. Skips, naming the
reason, without a GPU, without the engine or without ``KVSHARE_E2E_MODEL``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.engines.suite import injected_bundle

pytestmark = pytest.mark.gpu

MODEL_VARIABLE = "KVSHARE_E2E_MODEL"
READY_TIMEOUT_S = 900
PROMPTS = [
    "The capital of France is",
    "Write a haiku about memory:",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Translate 'good morning' into German:",
]
MAX_TOKENS = 48


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(engine: str, model: str, port: int) -> list[str]:
    if engine == "vllm":
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--seed",
            "0",
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--enable-prefix-caching",
        ]
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--random-seed",
        "0",
        "--context-length",
        "2048",
        "--disable-cuda-graph",
    ]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, OSError):
        return 0


@contextmanager
def _server(engine: str, model: str, kvshare: Path | None, log: Path) -> Iterator[str]:
    port = _free_port()
    environ = dict(os.environ)
    if kvshare is not None:
        environ.update(
            {
                "PYTHONPATH": os.pathsep.join([str(kvshare), environ.get("PYTHONPATH", "")]),
                "KVSHARE_ENABLE": "1",
                "KVSHARE_BACKEND": "cuda",
                "KVSHARE_KV_LIMIT": "4Gi",
                "KVSHARE_KV_MAX": "8Gi",
                "KVSHARE_BROKER_SOCKET": str(log.parent / "no-broker.sock"),
            }
        )
    with log.open("w") as out:
        process = subprocess.Popen(
            _command(engine, model, port), env=environ, stdout=out, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _get(f"{base}/health") != 200:
            if process.poll() is not None:
                pytest.fail(f"{engine} exited ({process.returncode}):\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{engine} not ready in {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
                )
            time.sleep(2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _complete(base: str, model: str, prompt: str) -> str:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def _greedy_outputs(base: str, model: str) -> list[str]:
    # Twice: the second round is served from the prefix cache.
    return [_complete(base, model, prompt) for prompt in PROMPTS * 2]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_greedy_tokens_are_the_same_with_and_without_kvshare(engine: str, tmp_path: Path) -> None:
    model = os.environ.get(MODEL_VARIABLE)
    if not model:
        pytest.skip(f"set {MODEL_VARIABLE} to a small model (a Hugging Face id or a local path)")
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed in this environment")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bundle = injected_bundle(tmp_path / "bundle")  # cuda-python comes from this environment
    with _server(engine, model, None, tmp_path / "plain.log") as base:
        plain = _greedy_outputs(base, model)
    with _server(engine, model, bundle, tmp_path / "kvshare.log") as base:
        shared = _greedy_outputs(base, model)
    log = (tmp_path / "kvshare.log").read_text()
    assert "kvshare patched" in log, "the kvshare server did not report its patches"
    assert shared == plain
