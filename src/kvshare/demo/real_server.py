"""One real model server of the demo: ``vllm serve`` driven by its model's share of the trace.

Run as its own process by the demo's orchestrator (``kvshare demo --engine vllm``), in
place of the simulated :mod:`kvshare.demo.server`, and speaking the same protocol::

    python -m kvshare.demo.real_server --trace FILE --model 0 --mode elastic

It starts vLLM's CPU build (:class:`~kvshare.demo.serving.vllm_server.VllmServer`,
``make engines``) serving the tiny model: plain vLLM with a KV cache of a static equal
share (``--mode static``, what ``--kv-cache-memory-bytes`` gives a model today), or vLLM
with kvshare's hooks leased by the node agent's broker (``--mode elastic``, the
``KVSHARE_*`` environment from the orchestrator, as the operator would give a pod). Once
its API answers it prints ``{"kind": "ready"}``, waits for ``{"start": T0}`` and replays
its model's requests in real time (a real engine runs at its own speed), as clients
would: each one a streamed greedy completion over the OpenAI API sent at its arrival
time, given up (the connection closed) if no token came within the trace's patience. It
samples the server every ``--sample-s`` and reports one ``result`` at the trace's end,
with the simulated servers' meanings:

- *served*: the stream finished (every token) within the trace's duration;
- *abandoned*: no first token within the patience;
- *queueing delay*: time to the first token (the patience for an abandoned request, the
  time waited so far for one still waiting at the end).

KV memory in the samples: a static server holds its whole share from the start (vLLM
allocates its KV cache up front); an elastic server's lease and held bytes are its pool's
in the broker's books (the agent's metrics, ``--agent-metrics``), and its use is vLLM's
own KV usage gauge times that lease.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvshare.api import env
from kvshare.demo import trace as trace_mod
from kvshare.demo.server import Channel, run_server, wait_for_start
from kvshare.demo.serving.client import MetricSample, scrape, stream_complete, total
from kvshare.demo.serving.environment import find_serving
from kvshare.demo.serving.tiny_model import VOCAB
from kvshare.demo.serving.vllm_server import ServerOptions, VllmServer
from kvshare.demo.stats import Sample, ServerResult

log = logging.getLogger(__name__)

__all__ = ["main", "prompt_ids", "replay_and_sample", "trace_config"]

MIB = 2**20
#: KV bytes per token of the tiny model: 4 layers x (K + V) x 2 KV heads x 64 x 4 bytes.
TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4
#: vLLM's CPU build needs a block size that is a multiple of 32.
BLOCK_TOKENS = 32
#: Longest prompt plus output the servers accept (``--max-model-len``).
MAX_MODEL_LEN = 2048
#: vLLM's histogram of tokens per engine step: its count is the steps taken.
STEPS_METRIC = "vllm:iteration_tokens_total_count"


def trace_config(
    *, seed: int, duration_s: float, models: int, gpu_memory_bytes: int, patience_s: float
) -> trace_mod.TraceConfig:
    """The demo's trace, sized for the tiny model on this machine's two cores.

    The same generator and load rules as the simulator's default trace (bursts staggered
    over the models, a busy model asking for what the whole GPU serves, a quiet one for a
    tenth of its share), with the tiny model's KV size per token and vLLM's CPU block size.
    Prompts are long and outputs short (median 512 and 64 tokens): a request holds many KV
    blocks for few decode steps, so on two cores KV memory, not arithmetic, is what a
    burst runs out of (see ``bench/elastic_vllm.py``). ``step_s`` = 15 ms sets the load:
    measured on this machine (one core per server, other jobs running), a server of these
    requests served 11-13 requests/s with the 7 in flight that a static share's KV cache
    holds, and 19 requests/s with 16 or more; at 15 ms a static share serves 6.2
    requests/s by the trace's own rule (Little's law over KV block-seconds), so a busy
    model's 19 requests/s are what three shares' KV cache serves and twice what one does.
    """
    return trace_mod.TraceConfig(
        seed=seed,
        duration_s=duration_s,
        models=models,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_bytes_per_token=TINY_KV_BYTES_PER_TOKEN,
        block_tokens=BLOCK_TOKENS,
        step_s=0.015,
        patience_s=patience_s,
        prompt=trace_mod.LengthMix(512, 0.6, 64, 1400),
        output=trace_mod.LengthMix(64, 0.6, 8, 400),
        prefix_tokens_low=128,
        prefix_tokens_high=384,
    )


def prompt_ids(config: trace_mod.TraceConfig, request: trace_mod.Request) -> list[int]:
    """The prompt's token ids: the model's system prompt (the same ids in every request
    that carries it, so vLLM's prefix cache shares it), then the request's own tokens."""
    system = random.Random(f"kvshare-demo-prompt:{config.seed}:{request.model}")
    ids = [system.randrange(2, VOCAB) for _ in range(request.prefix_tokens)]
    own = random.Random(f"kvshare-demo-prompt:{config.seed}:{request.model}:{request.rid}")
    ids += [own.randrange(2, VOCAB) for _ in range(request.prompt_tokens - request.prefix_tokens)]
    return ids


@dataclass
class _Client:
    """One request as its client sees it (owned by its own thread until ``done``)."""

    request: trace_mod.Request
    sent_at: float = 0.0
    first_token_s: float | None = None
    finished_at: float | None = None
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Replay:
    """Sends the model's requests at their arrival times, each from its own thread."""

    def __init__(
        self, url: str, config: trace_mod.TraceConfig, requests: Sequence[trace_mod.Request]
    ) -> None:
        self.url = url
        self.config = config
        self.clients = [_Client(r) for r in requests]
        self._next = 0

    def send_due(self, now_s: float, start: float) -> None:
        """Start every request whose arrival time has come (trace seconds ``now_s``)."""
        while (
            self._next < len(self.clients) and self.clients[self._next].request.arrival_s <= now_s
        ):
            client = self.clients[self._next]
            self._next += 1
            client.sent_at = start + client.request.arrival_s
            threading.Thread(target=self._serve, args=(client, start), daemon=True).start()

    def _serve(self, client: _Client, start: float) -> None:
        request = client.request
        try:
            done = stream_complete(
                self.url,
                prompt_ids(self.config, request),
                request.output_tokens,
                patience_s=self.config.patience_s,
            )
        except Exception as exc:  # a failed request is reported, not a crashed replay
            log.error("request %d failed: %s", request.rid, exc)
        else:
            client.abandoned = done.abandoned
            if done.ttft_s is not None:
                client.first_token_s = done.ttft_s
                if len(done.token_ids) == request.output_tokens:
                    client.finished_at = time.monotonic() - start
        finally:
            client.done.set()

    @property
    def arrived(self) -> list[_Client]:
        return self.clients[: self._next]

    def counts(self, now_s: float) -> tuple[int, int, int]:
        """Served, abandoned and arrived so far (at trace seconds ``now_s``)."""
        arrived = self.arrived
        served = sum(1 for c in arrived if c.finished_at is not None and c.finished_at <= now_s)
        abandoned = sum(1 for c in arrived if c.abandoned)
        return served, abandoned, len(arrived)

    def waits(self, end_s: float) -> tuple[list[float], list[float]]:
        """Queueing delay and arrival of every arrived request (see the module doc)."""
        waits, arrivals = [], []
        for client in self.arrived:
            if client.first_token_s is not None:
                wait = client.first_token_s
            elif client.abandoned:
                wait = self.config.patience_s
            else:
                wait = max(0.0, end_s - client.request.arrival_s)
            waits.append(wait)
            arrivals.append(client.request.arrival_s)
        return waits, arrivals


#: Seconds of leases a sample's ``lease_peak`` covers: the held bytes in the broker's books
#: are the pool's last report, which may have been made under a lease since lowered.
REPORT_LAG_S = 2.0


@dataclass
class _Memory:
    """Where a server's KV memory numbers come from, and the reclaims seen so far."""

    mode: str
    share_bytes: int
    pod: str
    agent_metrics: str | None
    last_lease: int | None = None
    leases: list[tuple[float, int]] = field(default_factory=list)
    reclaims: int = 0
    reclaimed_bytes: int = 0

    def read(self, vllm: Sequence[MetricSample]) -> tuple[int, int, int, int]:
        """Held, used and leased bytes now, and the most the pool may hold: the highest
        lease of the last :data:`REPORT_LAG_S` seconds, or what the broker books for it if
        that is more (the old lease until the pool acknowledges a reclaim). Leases are
        only seen at samples, so one raised and lowered again between two is seen through
        the booking alone."""
        usage = total(vllm, "vllm:kv_cache_usage_perc")
        if self.mode == "static" or self.agent_metrics is None:
            return (
                self.share_bytes,
                int(usage * self.share_bytes),
                self.share_bytes,
                self.share_bytes,
            )
        books = scrape(self.agent_metrics)
        lease = int(total(books, "kvshare_pool_kv_lease_bytes", pod=self.pod))
        held = int(
            total(books, "kvshare_pool_kv_mapped_bytes", pod=self.pod)
            + total(books, "kvshare_pool_kv_reserved_bytes", pod=self.pod)
        )
        if self.last_lease is not None and lease < self.last_lease:
            self.reclaims += 1
            self.reclaimed_bytes += self.last_lease - lease
        self.last_lease = lease
        now = time.monotonic()
        self.leases = [(t, b) for t, b in self.leases if now - t <= REPORT_LAG_S]
        self.leases.append((now, lease))
        charged = int(total(books, "kvshare_pool_kv_charged_bytes", pod=self.pod))
        return held, int(usage * lease), lease, max(charged, *(b for _, b in self.leases))


#: Seconds the last scrape of a server's metrics may take: its steps are in the result, and
#: a server still busy with the requests left at the trace's end answers slowly.
FINAL_SCRAPE_TIMEOUT_S = 30.0
#: Seconds the replay's and the sampler's loops sleep between looks at the clock.
TICK_S = 0.01


def replay_and_sample(
    start: float,
    duration_s: float,
    sample_s: float,
    send_due: Callable[[float], None],
    take_sample: Callable[[float], None],
) -> None:
    """Run the replay until ``duration_s`` trace seconds after ``start`` (monotonic), and
    take a sample every ``sample_s`` and at the end, on a thread of its own.

    A sample scrapes the server's metrics page (and the agent's), which a loaded API
    process answers late: on the replay's thread it would send the requests due meanwhile
    late, with the clients' patience counted from then. A sample whose scrape fails or
    times out is skipped with a warning; the next one is taken on time. Any other error
    of a sample ends the sampling and is raised here once the replay is over."""
    failed: list[BaseException] = []

    def sample_until_end() -> None:
        next_s = 0.0
        try:
            for now_s in _ticks(start, duration_s):
                if now_s >= next_s - 1e-9:
                    try:
                        take_sample(now_s)
                    except OSError as exc:  # urllib's errors and timeouts are OSErrors
                        log.warning("the sample at %.1f s is skipped: %s", now_s, exc)
                    elapsed_s = time.monotonic() - start
                    next_s = min(max(next_s + sample_s, elapsed_s), duration_s)
        except BaseException as exc:  # raised on the replay's thread below
            failed.append(exc)

    sampler = threading.Thread(target=sample_until_end, name="sampler", daemon=True)
    sampler.start()
    for now_s in _ticks(start, duration_s):
        send_due(now_s)
    sampler.join()
    if failed:
        raise failed[0]


def _ticks(start: float, duration_s: float) -> Iterator[float]:
    """Trace seconds since ``start`` (monotonic) every :data:`TICK_S`, up to and with
    ``duration_s`` itself."""
    while True:
        now_s = min(time.monotonic() - start, duration_s)
        yield now_s
        if now_s >= duration_s - 1e-9:
            return
        time.sleep(TICK_S)


def _sample(replay: Replay, server: VllmServer, memory: _Memory, now_s: float) -> Sample:
    vllm = scrape(f"{server.url}/metrics")
    held, used, lease, peak = memory.read(vllm)
    served, abandoned, arrived = replay.counts(now_s)
    return Sample(
        t=round(now_s, 4),
        served=served,
        abandoned=abandoned,
        arrived=arrived,
        waiting=int(total(vllm, "vllm:num_requests_waiting")),
        running=int(total(vllm, "vllm:num_requests_running")),
        held=held,
        used=used,
        lease=lease,
        lease_peak=peak,
        preemptions=int(total(vllm, "vllm:num_preemptions_total")),
        reclaims=memory.reclaims,
    )


def _options(args: argparse.Namespace) -> ServerOptions:
    elastic = args.mode == "elastic"
    return ServerOptions(
        kvshare=elastic,
        # The pool's settings the orchestrator gave this process, as a pod's containers get
        # them (a server never inherits kvshare settings by accident).
        env=env.configured() if elastic else {},
        kv_cache_bytes=None if elastic else args.share_bytes,
        environment=find_serving(args.vllm),
        cpu_bind=args.cpu,
        cache_root=Path(args.cache_root) if args.cache_root else None,
        block_size=BLOCK_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=128,
    )


def serve(args: argparse.Namespace, channel: Channel) -> None:
    """Start the server, replay the trace against it, report; stop it on the way out."""
    trace = trace_mod.load(Path(args.trace))
    config = trace.config
    requests = trace.for_model(args.model)
    name = f"{args.world or args.mode}-model-{args.model}"
    server = VllmServer(name, _options(args), Path(args.log_dir) / f"vllm-{name}.log")
    send = channel.send
    try:
        server.start().wait_ready(args.startup_timeout)
        send(json.dumps({"kind": "ready", "model": args.model, "mode": args.mode}))
        start = wait_for_start(sys.stdin)
        replay = Replay(server.url, config, requests)
        memory = _Memory(args.mode, args.share_bytes or 0, args.pod, args.agent_metrics)
        steps_before = total(scrape(f"{server.url}/metrics"), STEPS_METRIC)
        cpu_before = server.cpu_seconds()
        replay_and_sample(
            start,
            config.duration_s,
            args.sample_s,
            lambda now_s: replay.send_due(now_s, start),
            lambda now_s: send(_sample(replay, server, memory, now_s).to_json()),
        )
        served, abandoned, arrived = replay.counts(config.duration_s)
        waits, arrivals = replay.waits(config.duration_s)
        vllm = scrape(f"{server.url}/metrics", timeout_s=FINAL_SCRAPE_TIMEOUT_S)
        cpu_after = server.cpu_seconds()
        send(
            ServerResult(
                mode=args.mode,
                world=args.world or args.mode,
                model=args.model,
                offered=len(requests),
                arrived=arrived,
                served=served,
                abandoned=abandoned,
                preemptions=int(total(vllm, "vllm:num_preemptions_total")),
                reclaims=memory.reclaims,
                reclaimed_bytes=memory.reclaimed_bytes,
                waits_s=waits,
                wait_arrivals_s=arrivals,
                steps=int(total(vllm, STEPS_METRIC) - steps_before),
                cpu_s={
                    role: round(cpu_s - cpu_before.get(role, 0.0), 2)
                    for role, cpu_s in cpu_after.items()
                },
            ).to_json()
        )
    finally:
        # Clients of requests still waiting hold connections that vLLM's HTTP server would
        # wait for: the run is over, so the tree gets SIGKILL after a short grace.
        server.stop(timeout_s=10.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one real vLLM server of kvshare demo")
    parser.add_argument("--trace", required=True, help="trace file written by the orchestrator")
    parser.add_argument("--model", type=int, required=True, help="index of this model")
    parser.add_argument("--mode", choices=("static", "elastic"), required=True)
    parser.add_argument("--world", default="", help="the run it belongs to (default: its mode)")
    parser.add_argument("--share-bytes", type=int, help="KV cache of plain vLLM (--mode static)")
    parser.add_argument("--sample-s", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--vllm", default="0.32.0", help="serving environment (vLLM version)")
    parser.add_argument("--cpu", default="0", help="cores of the worker's threads")
    parser.add_argument("--pod", default="", help="the pod name of this server's pool")
    parser.add_argument("--agent-metrics", help="the node agent's metrics URL (--mode elastic)")
    parser.add_argument("--cache-root", help="VLLM_CACHE_ROOT shared by the run's servers")
    parser.add_argument("--log-dir", default=".", help="where vLLM's log goes")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    # The orchestrator's SIGTERM must still stop the vLLM server (``serve``'s finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return run_server(args, serve)


if __name__ == "__main__":
    sys.exit(main())
