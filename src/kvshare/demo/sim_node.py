"""A node of kvshare in simulated time: the real broker books and policy, the real KV pools
and the pools' side of the lease conversation, on one clock, with no processes and no
sockets.

What runs for real: :class:`~kvshare.deviceplugin.broker.books.Books` with the policy given, one
:class:`~kvshare.runtime.pool.KVPool` per model server with the geometry, reserve and
lease chunk given (over :mod:`~kvshare.demo.bookkeeping_backend`, which only bookkeeps
its pages: the lowest layer, which the simulation never reads or writes), each pool's
side of the lease conversation
(:class:`~kvshare.runtime.lease_conversation.LeaseConversation`, as in the broker
client), and the engine each pool serves. What stands in: the socket between a pool and
the broker is a delay (``latency_s`` each way), the pools' background threads run their
maintenance pass after every step of their engine, after each lease change and on their
report timer, and the broker's deadlines fire on time.

Time: :class:`SimClock` keeps the engines' time. kvshare's own delays (the latency, the
report intervals, the slow-start window, reclaim deadlines) are wall-clock times; a
``speed`` above 1 runs the engines' time that many times as fast as kvshare's, as the
demo does (``kvshare demo --speed``). Who decides when an engine steps is the caller's:
the demo's simulation lets every engine step at its own time
(:meth:`SimNode.start`); the GPU twin shares one device between them
(:mod:`kvshare.twin.arbiter`) and calls :meth:`SimNode.step_began` and
:meth:`SimNode.step_ended` around each step.

:mod:`kvshare.demo.elastic_sim` runs the demo's traces on this node; the GPU twin's
kvshare world (:mod:`kvshare.twin.worlds`) runs its workloads on it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvshare.api.wire import PROTOCOL_VERSION, Hello, Lease, Message, Reclaim, Report, Want
from kvshare.demo.bookkeeping_backend import BookkeepingBackend
from kvshare.demo.engine_sim import EngineSim
from kvshare.deviceplugin.broker.books import Books, Send
from kvshare.deviceplugin.broker.policy import Policy
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.runtime.broker_client import DEFAULT_SLOW_START_WINDOW_S
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage
from kvshare.runtime.lease_conversation import IDLE_S, LeaseConversation
from kvshare.runtime.pool import KVPool

__all__ = [
    "GPU_UUID",
    "LEASE_REPORT_INTERVAL_S",
    "POOL_REPORT_INTERVAL_S",
    "NodeSettings",
    "PoolSpec",
    "SimClock",
    "SimNode",
    "Watch",
]

GPU_UUID = "GPU-kvshare-sim"
#: The demo server's pool settings (see :mod:`kvshare.demo.server`).
POOL_REPORT_INTERVAL_S = 0.5
LEASE_REPORT_INTERVAL_S = 0.05


class SimClock:
    """The simulated time (the engines' seconds) and what is due when."""

    def __init__(self, speed: float = 1.0) -> None:
        self.now = 0.0
        self.speed = speed
        #: Set to end :meth:`run_until` before its end (after the action that set it).
        self.stopped = False
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def wall(self) -> float:
        """The time kvshare's own parts keep (wall seconds, before the speed-up)."""
        return self.now / self.speed

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``t`` (now, if ``t`` has passed); actions due at the same
        time run in the order they were asked for."""
        heapq.heappush(self._due, (max(t, self.now), next(self._order), action))

    def after_wall(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` ``seconds`` of kvshare's time from now."""
        self.at(self.now + seconds * self.speed, action)

    def run_until(self, end: float) -> None:
        """Run every action due before ``end`` (``math.inf``: until none is left or the
        clock is stopped)."""
        due = self._due
        while due and due[0][0] < end and not self.stopped:
            t, _, action = heapq.heappop(due)
            self.now = t
            action()
        if math.isfinite(end) and not self.stopped:
            self.now = end


@dataclass(frozen=True)
class PoolSpec:
    """One model server's pool on the simulated node."""

    name: str
    geometry: KVGeometry
    #: The pool's lease growth step, in bytes.
    chunk_bytes: int
    #: Its kvCache.min and kvCache.max, in bytes.
    kv_min: int
    kv_max: int
    #: Its static footprint (weights, activations, CUDA context), which the broker
    #: subtracts from the GPU's budget.
    static_bytes: int = 0
    priority: int = 100


@dataclass(frozen=True)
class NodeSettings:
    """The simulated GPU and the delays of the simulated node."""

    gpu_bytes: int
    #: Memory of the GPU the broker never lends (its headroom).
    headroom_bytes: int = 0
    #: The mapping granularity of the pools' (bookkept) backend.
    granularity: int = 2 * 2**20
    #: Wall seconds a message takes from a pool to the broker or back.
    latency_s: float = 0.001
    #: Engine seconds per wall second (see the module doc).
    speed: float = 1.0
    #: Seconds a pool has to honour a reclaim (the node agent's default).
    reclaim_deadline_s: float = 10.0
    #: Ready pages every pool keeps mapped ahead of its engine (None: the pool's default,
    #: the pages that hold :data:`~kvshare.runtime.pool_blocks.DEFAULT_RESERVE_BLOCKS`).
    reserve_pages: int | None = None
    #: A pool's maintenance pass after each step of its engine only when something woke
    #: its background thread (:meth:`KVPool.maintenance_due`), as the thread runs it;
    #: False: after every step (the demo's simulation, whose figures were measured so).
    maintain_when_woken: bool = False


class _SimLease(LeaseSource):
    """One pool's lease over a delayed link to the simulated broker (the broker client's
    part: its conversation, its lease thread's timing)."""

    def __init__(self, node: SimNode, model: int, hello: Hello, chunk: int) -> None:
        self._node = node
        self.model = model
        self.hello = hello
        self.pool_id = 0
        self._holder: LeaseHolder | None = None
        self._talk = LeaseConversation(
            chunk_bytes=chunk,
            page_size=hello.page_size,
            ceiling=hello.kv_max,
            report_interval_s=LEASE_REPORT_INTERVAL_S,
            slow_start_window_s=DEFAULT_SLOW_START_WINDOW_S,
        )
        self._send_scheduled = False

    def attach(self, holder: LeaseHolder) -> None:
        self._holder = holder
        admission = self._node.books.admit(self.hello, 1000 + self.model, self._node.clock.wall())
        if admission.record is None:
            raise RuntimeError(f"the simulated broker refused {self.hello.pod}: {admission.reason}")
        self.pool_id = admission.record.id
        self._node.leases[self.pool_id] = self
        self._talk.granted(admission.record.lease, self._node.clock.wall())
        self._node.deliver(admission.sends)

    def limit(self) -> int:
        return self._talk.limit

    def want(self, total_bytes: int) -> None:
        if self._talk.want(total_bytes, self._node.clock.wall()):
            self._send()

    def report(self, usage: PoolUsage) -> None:
        self._talk.report(usage)
        self._schedule_send(0.0)

    def _schedule_send(self, wall_s: float) -> None:
        if not self._send_scheduled:
            self._send_scheduled = True
            self._node.clock.after_wall(wall_s, self._send)

    def _send(self) -> None:
        """What the lease thread sends when it wakes (see ``BrokerLease._send_due``)."""
        self._send_scheduled = False
        want = self._talk.next_want()
        if want is not None:
            self._node.to_broker(self.pool_id, want)
        report, wait = self._talk.next_report(self._node.clock.wall())
        if report is not None:
            self._node.to_broker(self.pool_id, report)
        elif wait < IDLE_S:
            self._schedule_send(wait)

    def receive(self, message: Message) -> None:
        """A message from the broker arrives."""
        if isinstance(message, Lease):
            changed = self._talk.granted(message.limit, self._node.clock.wall())
        elif isinstance(message, Reclaim):
            self._talk.reclaimed(message)
            changed = True
        else:
            raise RuntimeError(f"unexpected {message!r} from the simulated broker")
        if changed and self._holder is not None:
            self._holder.lease_changed(self._talk.limit)
            self._node.maintain_soon(self.model)

    def close(self) -> None:
        self._node.books.remove(self.pool_id, "bye", self._node.clock.wall())


class SimNode:
    """The simulated node: the broker's books, the pools and their engines.

    ``make_engine(model, pool)`` builds the engine of the ``model``-th pool spec over its
    pool (the pool is the engine's block allocator).
    """

    def __init__(
        self,
        settings: NodeSettings,
        policy: Policy,
        pools: Sequence[PoolSpec],
        make_engine: Callable[[int, KVPool], EngineSim],
    ) -> None:
        self.settings = settings
        self.clock = SimClock(settings.speed)
        gpu = GpuInfo(uuid=GPU_UUID, index=0, name="simulated", total_bytes=settings.gpu_bytes)
        self.books = Books(
            [gpu],
            headroom=settings.headroom_bytes,
            reclaim_deadline_s=settings.reclaim_deadline_s,
            policy=policy,
        )
        self.leases: dict[int, _SimLease] = {}
        self.pools: list[KVPool] = []
        self.engines: list[EngineSim] = []
        self._maintaining: set[int] = set()
        self._tick_at: float | None = None
        self._starting = True
        for model, spec in enumerate(pools):
            hello = Hello(
                version=PROTOCOL_VERSION,
                gpu=GPU_UUID,
                page_size=spec.geometry.page_bytes,
                kv_min=spec.kv_min,
                kv_max=spec.kv_max,
                priority=spec.priority,
                static=spec.static_bytes,
                namespace="kvshare-sim",
                pod=spec.name,
                engine="kvshare-demo",
            )
            lease = _SimLease(self, model, hello, spec.chunk_bytes)
            pool = KVPool(
                spec.geometry,
                BookkeepingBackend(settings.granularity),
                lease,
                background=False,
                lease_chunk_bytes=spec.chunk_bytes,
                reserve_pages=settings.reserve_pages,
                report_interval_s=POOL_REPORT_INTERVAL_S,
                clock=self.clock.wall,
            )
            engine = make_engine(model, pool)
            pool.set_evictor(engine.prefix_cache)
            self.pools.append(pool)
            self.engines.append(engine)
        self._starting = False

    # --- messages -------------------------------------------------------------------------

    def to_broker(self, pool_id: int, message: Want | Report) -> None:
        """A pool's message, arriving at the broker after the latency."""

        def arrive() -> None:
            now = self.clock.wall()
            if isinstance(message, Want):
                sends = self.books.want(pool_id, message.seq, message.total, now)
            else:
                sends = self.books.report(pool_id, message, now)
            self.deliver(sends)

        if self._starting:
            arrive()
        else:
            self.clock.after_wall(self.settings.latency_s, arrive)

    def deliver(self, sends: Sequence[Send]) -> None:
        """The broker's messages, arriving at their pools after the latency."""
        for send in sends:
            lease = self.leases.get(send.key) if send.to == "pool" else None
            if lease is None:
                continue
            if self._starting:
                lease.receive(send.message)
            else:
                self.clock.after_wall(
                    self.settings.latency_s, functools.partial(lease.receive, send.message)
                )
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        deadline = self.books.next_deadline()
        if deadline is None:
            return
        at = deadline * self.clock.speed
        if self._tick_at is not None and self._tick_at <= at:
            return
        self._tick_at = at

        def tick() -> None:
            self._tick_at = None
            sends, _ = self.books.tick(self.clock.wall())
            self.deliver(sends)

        self.clock.at(at, tick)

    # --- pools and engines ------------------------------------------------------------------

    def maintain_soon(self, model: int) -> None:
        """Run the pool's maintenance pass now, after what is already due now."""
        if model in self._maintaining:
            return
        self._maintaining.add(model)

        def run() -> None:
            self._maintaining.discard(model)
            self.pools[model].maintain()

        self.clock.at(self.clock.now, run)

    def step_began(self, model: int) -> None:
        """The ``model``-th engine launched a step (its pool's step fence counts it)."""
        self.pools[model].steps.scheduled()

    def step_ended(self, model: int) -> None:
        """The ``model``-th engine's step is done: its pool's fence passes it, and the
        pool's maintenance pass runs (as its background thread would, woken by the step)."""
        pool = self.pools[model]
        pool.steps.finished()
        if not self.settings.maintain_when_woken or pool.maintenance_due():
            pool.maintain()

    def _step(self, model: int) -> None:
        self.step_began(model)
        self.engines[model].step()
        self.step_ended(model)
        self._schedule_engine(model)

    def _schedule_engine(self, model: int) -> None:
        start = self.engines[model].next_step_at()
        if start is not None:
            self.clock.at(start, lambda: self._step(model))

    def _timer(self, model: int) -> None:
        self.pools[model].maintenance_due()  # the thread's wait ends either way
        self.pools[model].maintain()
        self.clock.after_wall(POOL_REPORT_INTERVAL_S, lambda: self._timer(model))

    def start(self, *, own_clocks: bool) -> None:
        """Start every pool's report timer and, with ``own_clocks``, let every engine step
        at its own time, each as if it had a GPU of its own (the demo's simulation)."""
        for model in range(len(self.pools)):
            if own_clocks:
                self._schedule_engine(model)
            self.clock.after_wall(POOL_REPORT_INTERVAL_S, functools.partial(self._timer, model))

    def watch(self, watch: Watch) -> None:
        """Let ``watch`` sample the node now and every ``watch.interval_s``."""
        watch(self.pools, self.engines)
        self.clock.at(self.clock.now + watch.interval_s, lambda: self.watch(watch))

    def close(self) -> None:
        """Free every engine's blocks and close every pool."""
        for engine, pool in zip(self.engines, self.pools, strict=True):
            engine.close()
            pool.close()


class Watch(Protocol):
    """Looks at the simulated node every ``interval_s`` engine seconds, between events."""

    interval_s: float

    def __call__(self, pools: Sequence[KVPool], engines: Sequence[EngineSim]) -> None:
        """Sample the pools and their engines (model ``i`` is ``pools[i]``, ``engines[i]``)."""
