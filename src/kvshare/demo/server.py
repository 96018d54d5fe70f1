"""One simulated model server: a real KV pool driven in real time by the engine simulation.

Run as its own process by the demo's orchestrator::

    python -m kvshare.demo.server --trace FILE --model 0 --mode elastic

The pool is a real :class:`~kvshare.runtime.pool.KVPool` on the ``host`` backend (real
virtual memory: reserved ranges, physical pages committed and mapped, unmapped and
released). Its lease is either a fixed equal share of the GPU (``--mode static``, a
:class:`~kvshare.runtime.lease.StaticLease`) or the node agent's broker (``--mode
elastic``, configured through the ``KVSHARE_*`` environment the orchestrator sets, as the
operator would for a pod). Every block the engine allocates is stamped in the pool's
memory and checked when freed, so two owners of one block, or memory that was unmapped
under a live block, are caught.

Protocol with the orchestrator (JSON, one object per line): the server prints
``{"kind": "ready"}`` once its pool is up, waits for ``{"start": T0}`` on stdin (``T0`` a
``time.monotonic()`` instant, the common start of every server), then prints a
``sample`` every ``--sample-s`` seconds and one ``result`` when its clock reaches the
trace's duration or stdin closes. A failure is one ``{"kind": "error"}`` line and exit
status 1.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from kvshare.demo import trace as trace_mod
from kvshare.demo.engine_sim import EngineSim
from kvshare.demo.stats import Sample, ServerResult
from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage

if TYPE_CHECKING:
    from kvshare.runtime.geometry import KVGeometry
    from kvshare.runtime.pool import KVPool

log = logging.getLogger(__name__)

#: Layers of the simulated model: K and V of each are one pool buffer (per-layer layout).
DEMO_LAYERS = 32
#: Logical pages the GPU should hold at least, so that pages are not coarse for its size.
#: A real 80 GiB GPU with 2 MiB pages holds 640 logical pages of a 32-layer model; a
#: 4 GiB demo GPU keeps a similar granularity with 256 KiB pages (256 logical pages).
MIN_PAGES_PER_GPU = 256
MAX_PAGE_SIZE = 2 * 2**20
#: Lease growth step of an elastic pool, as a fraction of the GPU: the runtime's default
#: (256 MiB, a 320th of an 80 GiB GPU), rounded up to one logical page (16 MiB on the
#: demo's 4 GiB GPU).
LEASE_CHUNK_SHARE = 1 / 320


def lease_chunk_bytes(config: trace_mod.TraceConfig, geometry: KVGeometry) -> int:
    """The lease growth step of an elastic pool on the trace's GPU."""
    page = geometry.page_bytes
    return max(page, -(-int(config.gpu_memory_bytes * LEASE_CHUNK_SHARE) // page) * page)


class DemoConfigError(ValueError):
    """The trace's serving setup cannot be laid out as a KV pool."""


def demo_geometry(
    config: trace_mod.TraceConfig,
    granularity: int,
    page_blocks: int | None = None,
    *,
    block_outer: bool = False,
) -> KVGeometry:
    """The pool geometry of one simulated server: room for the whole GPU, per-layer.

    Pages are sized for :data:`MIN_PAGES_PER_GPU` unless ``page_blocks`` sets how many
    blocks one holds (a multiple of ``granularity`` in bytes). ``block_outer``: one buffer
    of whole blocks of every layer instead, a page the granules of one block (as vLLM's
    block-outer layouts are paged)."""
    from kvshare.runtime.geometry import KVGeometry

    if block_outer:
        block = config.block_bytes()
        page = -(-block // granularity) * granularity
        blocks = config.gpu_memory_bytes // block + 1
        return KVGeometry(num_buffers=1, block_bytes=block, num_blocks=blocks, page_size=page)

    buffers = 2 * DEMO_LAYERS
    block_bytes, rest = divmod(config.block_bytes(), buffers)
    if rest or block_bytes % 8:
        raise DemoConfigError(
            f"kv_bytes_per_token * block_tokens = {config.block_bytes()} does not split into "
            f"{buffers} buffers of whole 8-byte words; use a multiple of {buffers * 8}"
        )
    if page_blocks is not None:
        page = page_blocks * block_bytes
        if page_blocks < 1 or page % granularity:
            raise DemoConfigError(
                f"pages of {page_blocks} blocks of {block_bytes} bytes are not a positive "
                f"multiple of the backend's granularity ({granularity} bytes)"
            )
    else:
        page = MAX_PAGE_SIZE
        while (
            page > block_bytes
            and page > granularity
            and (buffers * page * MIN_PAGES_PER_GPU > config.gpu_memory_bytes)
        ):
            page //= 2
        page = max(page, granularity, block_bytes)
        page = -(-page // granularity) * granularity
    blocks_per_page = page // block_bytes
    pages = -(-(config.gpu_memory_bytes // (buffers * block_bytes) + 1) // blocks_per_page)
    return KVGeometry(
        num_buffers=buffers,
        block_bytes=block_bytes,
        num_blocks=pages * blocks_per_page,
        page_size=page,
        layout="per-layer",
    )


class ReclaimCounter(LeaseSource):
    """Wraps a lease source and counts the times it lowers the lease (reclaims)."""

    def __init__(self, inner: LeaseSource) -> None:
        self._inner = inner
        self._holder: LeaseHolder | None = None
        self._lock = threading.Lock()  # guards _last, _peak, reclaims, reclaimed_bytes
        self._last: int | None = None
        self._peak = 0
        self.reclaims = 0
        self.reclaimed_bytes = 0

    def attach(self, holder: LeaseHolder) -> None:
        self._holder = holder
        self._inner.attach(self)  # this counter is the inner source's holder
        with self._lock:
            self._last = self._peak = self._inner.limit()

    def take_peak(self) -> int:
        """The highest lease since the last call (the current one included)."""
        with self._lock:
            peak, self._peak = self._peak, self._last or 0
            return max(peak, self._peak)

    def lease_changed(self, limit: int) -> None:
        """Count a decrease, then pass the new limit on to the pool."""
        with self._lock:
            if self._last is not None and limit < self._last:
                self.reclaims += 1
                self.reclaimed_bytes += self._last - limit
            self._last = limit
            self._peak = max(self._peak, limit)
        if self._holder is not None:
            self._holder.lease_changed(limit)

    def limit(self) -> int:
        return self._inner.limit()

    def want(self, total_bytes: int) -> None:
        self._inner.want(total_bytes)

    def report(self, usage: PoolUsage) -> None:
        self._inner.report(usage)

    def close(self) -> None:
        self._inner.close()


class StampedBlocks:
    """The engine's view of the pool: every allocated block is stamped and checked on free.

    The first 8 bytes of a block in buffer 0 hold a number unique to the allocation that
    handed it out; :meth:`free` checks it is still there. A block handed to two owners, or
    a page unmapped under a live block, fails loudly instead of passing unnoticed. The
    stamps are written at the blocks' addresses (no torch: a server starts in a fraction
    of a second and holds a few tens of MB, so dozens of them fit beside each other).
    """

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self._owner: dict[int, int] = {}
        self._next = 1

    def _word(self, block: int) -> ctypes.c_int64:
        return ctypes.c_int64.from_address(self._pool.block_address(0, block))

    def expect_blocks(self, count: int) -> None:
        self._pool.expect_blocks(count)

    def alloc(self, n: int, *, running: bool = False) -> object:
        got = self._pool.alloc(n, running=running)
        if isinstance(got, list):
            stamp = self._next
            self._next += 1
            for block in got:
                if block in self._owner:
                    raise AssertionError(f"block {block} handed out twice")
                self._word(block).value = stamp
                self._owner[block] = stamp
        return got

    def free(self, ids: Iterable[int]) -> None:
        blocks = list(ids)
        for block in blocks:
            stamp = self._owner.pop(block, None)
            if stamp is None:
                raise AssertionError(f"block {block} freed but not allocated")
            found = self._word(block).value
            if found != stamp:
                raise AssertionError(f"block {block} holds {found}, not its stamp {stamp}")
        self._pool.free(blocks)


@dataclass
class Channel:
    """The JSON-lines link to the orchestrator (the real stdout, kept from library output)."""

    out: IO[str]

    def send(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


def open_channel() -> Channel:
    # Keep stdout for the protocol: anything else that prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout = sys.stderr
    return Channel(out)


def _lease(mode: str, share_bytes: int | None, page_bytes: int, chunk: int) -> ReclaimCounter:
    """A static equal share, or the broker's lease with this pool's policy and identity
    from the ``KVSHARE_*`` environment (as a model-server pod gets them)."""
    if mode == "static":
        from kvshare.runtime.lease import StaticLease

        if share_bytes is None:
            raise DemoConfigError("--mode static needs --share-bytes")
        return ReclaimCounter(StaticLease(share_bytes))
    from kvshare.runtime.broker_client import BrokerLease, PoolIdentity, PoolPolicy
    from kvshare.runtime.leases import gpu_for_rank

    policy = dataclasses.replace(PoolPolicy.from_env(), page_size=page_bytes)
    return ReclaimCounter(
        BrokerLease(
            gpu_for_rank(0),
            policy=policy,
            identity=PoolIdentity.from_env(engine="kvshare-demo"),
            chunk_bytes=chunk,
        )
    )


def wait_for_start(stdin: IO[str]) -> float:
    line = stdin.readline()
    if not line:
        raise SystemExit(0)  # the orchestrator went away before the start
    return float(json.loads(line)["start"])


def serve(args: argparse.Namespace, channel: Channel) -> None:
    """Run one server until its trace is over or the orchestrator closes stdin."""
    from kvshare.runtime.backends import open_backend
    from kvshare.runtime.pool import KVPool

    trace = trace_mod.load(Path(args.trace))
    config = trace.config
    requests = trace.for_model(args.model)
    backend = open_backend("host")
    geometry = demo_geometry(config, backend.granularity, block_outer=args.block_outer)
    chunk = lease_chunk_bytes(config, geometry)
    lease = _lease(args.mode, args.share_bytes, geometry.page_bytes, chunk)
    pool = KVPool(
        geometry,
        backend,
        lease,
        lease_chunk_bytes=chunk,
        report_interval_s=0.5,
    )
    try:
        engine = EngineSim(
            requests,
            StampedBlocks(pool),
            block_tokens=config.block_tokens,
            cost=config.step_cost(),
            patience_s=config.patience_s,
        )
        pool.set_evictor(engine.prefix_cache)
        channel.send(json.dumps({"kind": "ready", "model": args.model, "mode": args.mode}))
        start = wait_for_start(sys.stdin)
        clock = _Clock(engine, pool, lease, channel, args.sample_s, args.speed, config.duration_s)
        stopped = clock.run(start)
        waits, arrivals = engine.waits()
        result = ServerResult(
            mode=args.mode,
            world=args.world or args.mode,
            model=args.model,
            offered=len(requests),
            arrived=engine.stats.arrived,
            served=engine.stats.served,
            abandoned=engine.stats.abandoned,
            preemptions=engine.stats.preemptions,
            reclaims=lease.reclaims,
            reclaimed_bytes=lease.reclaimed_bytes,
            waits_s=waits,
            wait_arrivals_s=arrivals,
        )
        engine.close()
        channel.send(result.to_json())
        if stopped:
            log.info("stopped early by the orchestrator at %.1f s", engine.clock)
    finally:
        pool.close()


@dataclass
class _Clock:
    """Steps the engine on the wall clock from the common start; samples as it goes.

    The trace's time runs ``speed`` times as fast as the wall clock: a step of ``t``
    simulated seconds takes ``t / speed`` of wall time. Everything else
    (the broker, the pool's reserve thread, lease reports) keeps wall time, so their
    delays count ``speed`` times over in the trace's time.
    """

    engine: EngineSim
    pool: KVPool
    lease: ReclaimCounter
    channel: Channel
    sample_s: float
    speed: float
    duration_s: float

    def sample(self) -> Sample:
        peak = self.lease.take_peak()
        snap = self.pool.snapshot()
        state = self.engine.sample()
        return Sample(
            # The last step may end after the trace does: the run ends with the trace.
            t=round(min(state.t, self.duration_s), 4),
            served=state.served,
            abandoned=self.engine.stats.abandoned,
            arrived=self.engine.stats.arrived,
            waiting=state.waiting,
            running=state.running,
            held=snap.held,
            used=snap.used,
            lease=snap.lease,
            lease_peak=max(peak, snap.lease),
            preemptions=self.engine.stats.preemptions,
            reclaims=self.lease.reclaims,
        )

    def run(self, start: float) -> bool:
        """Step until the trace's end; returns True when stdin closed first (stopped early)."""
        engine, duration_s = self.engine, self.duration_s
        watcher = selectors.DefaultSelector()
        watcher.register(sys.stdin, selectors.EVENT_READ)
        next_sample = 0.0
        while True:
            engine.advance(min((time.monotonic() - start) * self.speed, duration_s))
            if engine.clock >= duration_s - 1e-9:
                self.channel.send(self.sample().to_json())  # the last one, at the end
                return False
            if engine.clock >= next_sample - 1e-9:
                self.channel.send(self.sample().to_json())
                next_sample += self.sample_s
            next_step = engine.next_step_at()
            due_t = min(next_sample, duration_s if next_step is None else next_step)
            wait = max(0.0, start + due_t / self.speed - time.monotonic())
            if watcher.select(timeout=wait) and not sys.stdin.readline():
                return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one simulated model server of kvshare demo")
    parser.add_argument("--trace", required=True, help="trace file written by the orchestrator")
    parser.add_argument("--model", type=int, required=True, help="index of this model")
    parser.add_argument("--mode", choices=("static", "elastic"), required=True)
    parser.add_argument("--world", default="", help="the run it belongs to (default: its mode)")
    parser.add_argument("--share-bytes", type=int, help="static lease (--mode static)")
    parser.add_argument(
        "--sample-s", type=float, default=0.25, help="trace seconds between samples"
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="trace seconds per wall-clock second"
    )
    parser.add_argument(
        "--block-outer",
        action="store_true",
        help="page the pool by the block (one buffer of all layers), not per layer",
    )
    return run_server(parser.parse_args(argv), serve)


def run_server(
    args: argparse.Namespace, serve: Callable[[argparse.Namespace, Channel], None]
) -> int:
    """A demo server process's frame: logs to stderr, the channel on stdout, ``serve``, and
    any failure reported to the orchestrator as an ``error`` message (exit status 1)."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s {args.mode}-{args.model} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    channel = open_channel()
    try:
        serve(args, channel)
    except Exception as exc:
        log.exception("model server failed")
        channel.send(json.dumps({"kind": "error", "message": f"{type(exc).__name__}: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
