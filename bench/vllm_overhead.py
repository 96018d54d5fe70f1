"""Benchmark ``vllm-overhead``: one real ``vllm serve`` with kvshare against the same without.

Two servers of vLLM's CPU build (``make engines``) serve the tiny model with the same KV
cache size: plain vLLM given ``--kv-cache-memory-bytes``, and vLLM with kvshare's hooks on
the ``host`` backend with a standalone lease of that size (``KVSHARE_KV_LIMIT``; no node
agent, so nothing else contends). Each is started alone and timed until its API answers
(``*_startup_s``). Then rounds alternate between them, one server loaded at a time: every
round sends the same prompts (``REQUESTS`` streamed greedy requests of ``PROMPT`` tokens,
``OUTPUT`` generated tokens each, all at once) to one server, then to the other, in an
order that alternates from round to round; ``*_tokens_per_s`` is the median over the
rounds of generated tokens over the round's wall time, ``*_ttft_p50_s`` the median time
to the first token. Both servers bind their worker to the same core (``CORES``), leaving
the other to their API servers and the clients: with the worker's threads on both cores,
they starve the API server and requests reach the engine one by one. The KV cache holds
every request of a round at once: no preemption, so both do the same work.
``ratio`` is the median over the rounds of kvshare's tokens/s over plain vLLM's in the
same round: on a shared virtual machine the speed of both drifts by a factor of two over
minutes, and a ratio taken within a round cancels that drift where a ratio of the two
medians would not.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Result, Target
from kvshare.demo.serving.client import StreamedCompletion, stream_complete
from kvshare.demo.serving.environment import DEFAULT_SERVING
from kvshare.demo.serving.tiny_model import VOCAB
from kvshare.demo.serving.vllm_server import ServerOptions, VllmServer

MIB = 2**20
KV_BYTES = 192 * MIB
REQUESTS = 32
PROMPT = 256
OUTPUT = 512
CORES = "1"
#: The servers' logs, kept after the run.
LOGS = Path(__file__).resolve().parents[1] / "out" / "bench" / "vllm-overhead"


def prompts(count: int) -> list[list[int]]:
    """``count`` fixed prompts of distinct tokens (no prefix shared between them)."""
    return [
        [2 + (i * 7919 + j * 104729) % (VOCAB - 2) for j in range(PROMPT)] for i in range(count)
    ]


def one_round(server: VllmServer, asks: list[list[int]]) -> tuple[float, list[float]]:
    """Every prompt at once; generated tokens per second and each request's TTFT."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(asks)) as pool:
        done: list[StreamedCompletion] = list(
            pool.map(lambda prompt: stream_complete(server.url, prompt, OUTPUT), asks)
        )
    wall = time.monotonic() - started
    generated = sum(len(c.token_ids) for c in done)
    if generated != len(asks) * OUTPUT:
        raise RuntimeError(f"{server.name} generated {generated} of {len(asks) * OUTPUT} tokens")
    return generated / wall, [c.ttft_s for c in done if c.ttft_s is not None]


def run(quick: bool) -> Result:
    rounds = 2 if quick else 10
    asks = prompts(REQUESTS // 2 if quick else REQUESTS)
    out = LOGS
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-vllm-") as scratch:
        common = {"cpu_bind": CORES, "cache_root": out / "vllm-cache", "max_num_seqs": REQUESTS}
        servers = {
            "plain": VllmServer(
                "plain",
                ServerOptions(kvshare=False, kv_cache_bytes=KV_BYTES, **common),  # type: ignore[arg-type]
                out / "plain.log",
            ),
            "kvshare": VllmServer(
                "kvshare",
                ServerOptions(
                    kvshare=True,
                    env={
                        "KVSHARE_KV_LIMIT": str(KV_BYTES),
                        "KVSHARE_BROKER_SOCKET": str(Path(scratch) / "no-node-agent.sock"),
                    },
                    **common,  # type: ignore[arg-type]
                ),
                out / "kvshare.log",
            ),
        }
        try:
            for server in servers.values():  # one at a time: start-up uncontended
                server.start().wait_ready()
                one_round(server, asks[:4])  # warm-up
            speed: dict[str, list[float]] = {name: [] for name in servers}
            ttft: dict[str, list[float]] = {name: [] for name in servers}
            for index in range(rounds):
                order = list(servers) if index % 2 == 0 else list(reversed(servers))
                for name in order:
                    tokens_per_s, ttfts = one_round(servers[name], asks)
                    speed[name].append(tokens_per_s)
                    ttft[name].extend(ttfts)
                    print(
                        f"  round {index + 1} {name}: {tokens_per_s:.0f} tokens/s", file=sys.stderr
                    )
        finally:
            for server in servers.values():
                server.stop()
    median = {name: statistics.median(values) for name, values in speed.items()}
    paired = [mine / plain for mine, plain in zip(speed["kvshare"], speed["plain"], strict=True)]
    return Result(
        name="vllm-overhead",
        fields={
            "plain_tokens_per_s": round(median["plain"], 1),
            "kvshare_tokens_per_s": round(median["kvshare"], 1),
            "ratio": round(statistics.median(paired), 4),
            # The rounds' spread: how far one round's ratio strays on this machine.
            "ratio_min": round(min(paired), 4),
            "ratio_max": round(max(paired), 4),
            "ratio_of_medians": round(median["kvshare"] / median["plain"], 4),
            "plain_ttft_p50_s": round(statistics.median(ttft["plain"]), 4),
            "kvshare_ttft_p50_s": round(statistics.median(ttft["kvshare"]), 4),
            "plain_startup_s": round(servers["plain"].ready_after_s or 0.0, 1),
            "kvshare_startup_s": round(servers["kvshare"].ready_after_s or 0.0, 1),
            "rounds": rounds,
        },
        targets=[Target("ratio", ">=", 0.97)],
        notes=(
            f"{DEFAULT_SERVING.package} {DEFAULT_SERVING.version}, the generated tiny Llama "
            f"(float32, --enforce-eager), {len(asks)} streamed requests of {PROMPT} + "
            f"{OUTPUT} tokens per round, KV cache {KV_BYTES // MIB} MiB both ways, worker on "
            f"core {CORES}, rounds alternating; medians of {rounds} rounds, ratio the median "
            f"of the rounds' ratios. Logs: {LOGS.relative_to(LOGS.parents[2])}."
        ),
    )
