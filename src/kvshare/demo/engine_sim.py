"""A simulated LLM engine scheduler over a KV block allocator, stepped by a clock.

The simulation does what a vLLM-style scheduler does with KV memory, and nothing else:

- **Admission.** A request that has arrived waits in a FIFO queue until its prompt's KV
  blocks (plus the first output token) can be allocated; the head of the queue blocks the
  rest, as in vLLM. Its *queueing delay* is the time from arrival to first admission.
  Admission also pauses while the pool is giving memory back (``admission_open`` says
  no: its lease was lowered below what it holds). Otherwise new requests would keep
  filling the free blocks of partly used pages, no page would ever empty, and the
  reclaim that a neighbour is waiting for would never complete. Running requests still
  grow (or are preempted), so the pool shrinks as they finish.
- **Decode.** Every step, each running request produces one token; when its tokens cross
  a block boundary it needs one more block.
- **Preemption.** A running request that cannot grow makes the scheduler preempt the most
  recently admitted running request (possibly itself): its blocks are freed and it goes
  back to the front of the queue, to be recomputed from scratch (vLLM's recompute
  preemption). No admission happens in a step that preempted.
- **Completion.** A request that has produced all its tokens frees its blocks and counts
  as served.
- **Prefix cache.** Requests that start with the model's system prompt share its full
  blocks. When the last request using them finishes, the blocks stay cached; they are
  evicted from the tail when the allocator runs short or the pool is asked to shrink
  (:class:`PrefixCache` is the pool's ``Evictor``).

Time: a fixed time per decode step (``step_s``). This is the KV-capacity-bound regime —
batch size, limited by KV memory, sets throughput, not compute — which is where sharing
KV memory between models matters. Prefill costs one step. The caller drives the clock
with :meth:`EngineSim.advance`; step ``k`` happens at logical time ``k * step_s``, so the
results depend only on the trace and on what the allocator grants, not on how promptly
the caller's process was scheduled.

Threads: the engine is driven from one thread. The pool may call the prefix cache's
``evict`` from another thread (a lease reclaim); the cache guards its state with its own
lock and never calls the allocator while holding it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvshare.demo.trace import Request

__all__ = ["BlockAllocator", "EngineSample", "EngineSim", "EngineStats", "PrefixCache"]


class BlockAllocator(Protocol):
    """The part of ``KVPool`` the engine uses (see :mod:`kvshare.runtime.pool`)."""

    def alloc(self, n: int) -> object:
        """``n`` block ids as a ``list[int]``, or a falsy "no space" result."""

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back."""


class PrefixCache:
    """One model's system-prompt blocks: shared by the requests using them, then cached.

    The blocks form one chain (block ``i`` holds tokens ``[i * B, (i + 1) * B)`` of the
    prefix). While any running request references the chain it is in use; otherwise it is
    cached and :meth:`evict` frees blocks from its tail.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self._allocator = allocator
        self._lock = threading.Lock()  # guards _chain and _refs; never held across allocator calls
        self._chain: list[int] = []
        self._refs = 0
        self.evicted_blocks = 0

    def acquire(self) -> int:
        """Reference the chain (so it cannot be evicted); returns its length in blocks."""
        with self._lock:
            self._refs += 1
            return len(self._chain)

    def extend(self, blocks: Sequence[int]) -> None:
        """Append freshly computed prefix blocks to the chain (caller holds a reference)."""
        with self._lock:
            self._chain.extend(blocks)

    def release(self) -> None:
        """Drop one reference; at zero the chain becomes evictable cache."""
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("prefix cache released more often than acquired")
            self._refs -= 1

    def in_use_blocks(self) -> int:
        """Chain blocks referenced by running requests."""
        with self._lock:
            return len(self._chain) if self._refs else 0

    def cached_blocks(self) -> int:
        """Blocks held only as cache: what :meth:`evict` could free now."""
        with self._lock:
            return 0 if self._refs else len(self._chain)

    def evict(self, n: int) -> int:
        """Free up to ``n`` unreferenced blocks from the chain's tail; returns how many."""
        with self._lock:
            if self._refs or n <= 0:
                return 0
            victims = self._chain[-n:]
            del self._chain[-n:]
            self.evicted_blocks += len(victims)
        if victims:
            self._allocator.free(victims)
        return len(victims)


@dataclass
class _Running:
    request: Request
    blocks: list[int]  # blocks this request owns (its share of the prefix chain excluded)
    prefix_blocks: int  # full blocks of the shared prefix it references (0 = none)
    generated: int = 0

    def tokens(self) -> int:
        return self.request.prompt_tokens + self.generated


@dataclass(frozen=True)
class EngineSample:
    """The engine's state after one step."""

    t: float
    running: int
    waiting: int
    served: int
    used_blocks: int
    cached_blocks: int


@dataclass
class EngineStats:
    """Counts since the start; ``waits_s`` has one queueing delay per admitted request."""

    arrived: int = 0
    served: int = 0
    preemptions: int = 0
    waits_s: list[float] = field(default_factory=list)
    #: Arrival times matching ``waits_s`` (to plot delay against time).
    wait_arrivals_s: list[float] = field(default_factory=list)


class EngineSim:
    """One model's scheduler. See the module documentation for the rules it follows."""

    def __init__(
        self,
        requests: Sequence[Request],
        allocator: BlockAllocator,
        *,
        block_tokens: int,
        step_s: float,
        max_running: int = 256,
        admission_open: Callable[[], bool] = lambda: True,
    ) -> None:
        if block_tokens < 1 or not step_s > 0 or max_running < 1:
            raise ValueError("need block_tokens >= 1, step_s > 0 and max_running >= 1")
        self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self._allocator = allocator
        self._block_tokens = block_tokens
        self.step_s = step_s
        self._max_running = max_running
        self._admission_open = admission_open
        self.prefix_cache = PrefixCache(allocator)
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self._admitted: set[int] = set()
        self._steps = 0
        self.total = len(self._pending)
        self.stats = EngineStats()

    # --- clock -------------------------------------------------------------------------
    @property
    def clock(self) -> float:
        """Logical time of the last step taken."""
        return self._steps * self.step_s

    def advance(self, now: float) -> int:
        """Take every step due at or before ``now``; returns how many were taken."""
        taken = 0
        while (self._steps + 1) * self.step_s <= now + 1e-9:
            self.step()
            taken += 1
        return taken

    def finished(self) -> bool:
        """Every request of the trace has been served."""
        return self.stats.served == self.total

    # --- one step ----------------------------------------------------------------------
    def step(self) -> EngineSample:
        """One scheduler step at logical time ``clock + step_s``."""
        self._steps += 1
        now = self.clock
        while self._pending and self._pending[0].arrival_s <= now + 1e-9:
            self._waiting.append(self._pending.popleft())
            self.stats.arrived += 1
        preempted = self._decode()
        if not preempted and self._waiting and self._admission_open():
            self._admit(now)
        self._finish()
        return self.sample()

    def sample(self) -> EngineSample:
        """The engine's state now."""
        return EngineSample(
            t=self.clock,
            running=len(self._running),
            waiting=len(self._waiting),
            served=self.stats.served,
            used_blocks=self.used_blocks(),
            cached_blocks=self.prefix_cache.cached_blocks(),
        )

    def used_blocks(self) -> int:
        """Blocks referenced by running requests (own blocks plus the shared prefix)."""
        return sum(len(r.blocks) for r in self._running) + self.prefix_cache.in_use_blocks()

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block_tokens)

    def _alloc(self, n: int) -> list[int] | None:
        """``n`` blocks, evicting own cached prefix blocks if that is what it takes."""
        got = self._allocator.alloc(n)
        if isinstance(got, list):
            return got
        if self.prefix_cache.evict(n):
            got = self._allocator.alloc(n)
            if isinstance(got, list):
                return got
        return None

    def _decode(self) -> bool:
        """Grow every running request by one token; returns whether any was preempted."""
        preempted = False
        index = 0
        while index < len(self._running):
            current = self._running[index]
            held = len(current.blocks) + current.prefix_blocks
            need = self._blocks_for(current.tokens() + 1) - held
            grown = True
            while need > 0:
                got = self._alloc(need)
                if got is not None:
                    current.blocks.extend(got)
                    break
                victim = self._running.pop()
                self._preempt(victim)
                preempted = True
                if victim is current:
                    grown = False
                    break
            if grown:
                current.generated += 1
                index += 1
        return preempted

    def _preempt(self, victim: _Running) -> None:
        self._release(victim)
        self._waiting.appendleft(victim.request)
        self.stats.preemptions += 1

    def _release(self, entry: _Running) -> None:
        self._allocator.free(entry.blocks)
        entry.blocks = []
        if entry.request.prefix_tokens:
            self.prefix_cache.release()

    def _admit(self, now: float) -> None:
        """Admit waiting requests in FIFO order while their prompt blocks can be had."""
        while self._waiting and len(self._running) < self._max_running:
            request = self._waiting[0]
            needed = self._blocks_for(request.prompt_tokens + 1)
            full_prefix = request.prefix_tokens // self._block_tokens
            cached = self.prefix_cache.acquire() if request.prefix_tokens else 0
            cached = min(cached, full_prefix)
            got = self._alloc(needed - cached)
            if got is None:
                if request.prefix_tokens:
                    self.prefix_cache.release()
                return
            if request.prefix_tokens:
                # The prefix blocks this request computed join the shared chain.
                self.prefix_cache.extend(got[: full_prefix - cached])
                got = got[full_prefix - cached :]
            self._waiting.popleft()
            self._running.append(
                _Running(request, got, full_prefix if request.prefix_tokens else 0, generated=1)
            )
            if request.rid not in self._admitted:
                self._admitted.add(request.rid)
                self.stats.waits_s.append(max(0.0, now - request.arrival_s))
                self.stats.wait_arrivals_s.append(request.arrival_s)

    def _finish(self) -> None:
        still = []
        for entry in self._running:
            if entry.generated >= entry.request.output_tokens:
                self._release(entry)
                self.stats.served += 1
            else:
                still.append(entry)
        self._running = still

    def waits(self) -> tuple[list[float], list[float]]:
        """Queueing delay and arrival time of every arrived request.

        Requests never admitted so far count with the time they have waited until now.
        """
        waits = list(self.stats.waits_s)
        arrivals = list(self.stats.wait_arrivals_s)
        for request in self._waiting:
            if request.rid not in self._admitted:
                waits.append(max(0.0, self.clock - request.arrival_s))
                arrivals.append(request.arrival_s)
        return waits, arrivals

    def close(self) -> None:
        """Free every block the engine holds (running requests and the prefix cache)."""
        for entry in self._running:
            self._release(entry)
        self._running = []
        self.prefix_cache.evict(self.prefix_cache.cached_blocks())
