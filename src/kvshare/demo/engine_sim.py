"""A simulated LLM engine scheduler over a KV block allocator, stepped by a clock.

The simulation does what a vLLM-style scheduler does with KV memory, and nothing else:

- **Admission.** A request that has arrived waits in a FIFO queue until its prompt's KV
  blocks (plus the first output token) can be allocated; the head of the queue blocks the
  rest, as in vLLM. Its *queueing delay* is the time from arrival to first admission,
  which is also when its first token comes (prefill takes one step). The scheduler asks
  the allocator whenever it has work: while the pool gives memory back after a reclaim,
  the pool itself serves only from the pages it keeps and says no once they are full.
- **Patience.** A client whose first token has not come ``patience_s`` after it sent the
  request gives up: the request leaves the queue, or is dropped when its patience ran
  out during the step computing its first token, and counts as *abandoned* (its queueing
  delay counts as ``patience_s``). A request that was admitted once has streamed its
  first token, so its client stays even if it is preempted later.
- **Decode.** Every step, each running request produces one token; when its tokens cross
  a block boundary it needs one more block.
- **Preemption.** A running request that cannot grow makes the scheduler preempt the most
  recently admitted running request (possibly itself): its blocks are freed and it goes
  back to the front of the queue; when admitted again it recomputes its prompt and the
  tokens it had generated in one prefill and goes on from there (vLLM's recompute
  preemption). No admission happens in a step that preempted.
- **Completion.** A request that has produced all its tokens frees its blocks and counts
  as served.
- **Prefix cache.** Requests that start with the model's system prompt share its full
  blocks. When the last request using them finishes, the blocks stay cached; they are
  evicted from the tail when the allocator runs short or the pool is asked to shrink
  (:class:`PrefixCache` is the pool's ``Evictor``).

Time: a step costs what the batch in it costs (:class:`StepCost`): a fixed part, a part
per token computed — the prompt tokens of the requests admitted in it (less the cached
prefix) and one token per running request — and a part per token of context its
decoding requests attend to. So a bigger batch streams more tokens per second in all,
but each of its requests fewer, as on a real engine; with no cost per token every step
takes the fixed time, and throughput is proportional to the memory the batch holds. A
step's tokens are capped (``max_tokens``, vLLM's ``max_num_batched_tokens``): running
requests first, then admissions while the budget lasts (the first admission of a step
always, as chunked prefill would start it). A request's first token comes at the end
of its admission step. An engine with nothing to do waits for the next arrival instead
of stepping. The caller drives the clock with :meth:`EngineSim.advance`; steps happen at
logical times, so the results depend only on the trace and on what the allocator
grants, not on how promptly the caller's process was scheduled.

Threads: the engine is driven from one thread. The pool may call the prefix cache's
``evict`` from another thread (a lease reclaim); the cache guards its state with its own
lock and never calls the allocator while holding it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvshare.demo.trace import Request

__all__ = ["BlockAllocator", "EngineSample", "EngineSim", "EngineStats", "PrefixCache", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    """What one scheduler step costs, in seconds::

        fixed_s + per_token_s * tokens computed + per_context_token_s * context tokens

    *Tokens computed* are the prompt tokens of the requests admitted in the step (less
    their cached prefix) and one per running request; *context tokens* are the tokens
    already in the KV cache of the running requests, which attention reads once per step.
    """

    fixed_s: float
    """Seconds of a step whatever its batch (reading the weights, scheduling, sampling)."""
    per_token_s: float = 0.0
    """Seconds per token computed in the step (prompt tokens and decoded tokens alike)."""
    per_context_token_s: float = 0.0
    """Seconds per token of KV cache that the step's decoding requests attend to."""
    max_tokens: int | None = None
    """Most tokens one step computes (None: no cap)."""

    def __post_init__(self) -> None:
        if not self.fixed_s > 0 or min(self.per_token_s, self.per_context_token_s) < 0:
            raise ValueError("a step needs fixed_s > 0 and per-token costs >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")

    def seconds(self, tokens: float, context: float = 0.0) -> float:
        """How long a step computing ``tokens`` tokens over ``context`` cached ones takes."""
        return self.fixed_s + self.per_token_s * tokens + self.per_context_token_s * context


class BlockAllocator(Protocol):
    """The part of ``KVPool`` the engine uses (see :mod:`kvshare.runtime.pool`)."""

    def alloc(self, n: int, *, running: bool = False) -> object:
        """``n`` block ids as a ``list[int]``, or a falsy "no space" result. ``running``:
        they grow a running request (not one being admitted)."""

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back."""

    def set_running_requests(self, count: int) -> None:
        """The engine runs ``count`` requests into its next step (said after each step)."""


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
    abandoned: int = 0
    preemptions: int = 0
    waits_s: list[float] = field(default_factory=list)
    #: Arrival times matching ``waits_s`` (to plot delay against time).
    wait_arrivals_s: list[float] = field(default_factory=list)

    def record_wait(self, wait_s: float, arrival_s: float) -> None:
        """One request's queueing delay (admitted or abandoned)."""
        self.waits_s.append(wait_s)
        self.wait_arrivals_s.append(arrival_s)


class EngineSim:
    """One model's scheduler. See the module documentation for the rules it follows."""

    def __init__(
        self,
        requests: Sequence[Request],
        allocator: BlockAllocator,
        *,
        block_tokens: int,
        cost: StepCost,
        max_running: int = 256,
        patience_s: float | None = None,
    ) -> None:
        if block_tokens < 1 or max_running < 1:
            raise ValueError("need block_tokens >= 1 and max_running >= 1")
        if patience_s is not None and not patience_s > 0:
            raise ValueError(
                f"patience_s must be > 0 (or None: clients wait forever), not {patience_s}"
            )
        self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self._allocator = allocator
        self._block_tokens = block_tokens
        self.cost = cost
        self._max_running = max_running
        self._patience_s = patience_s
        self.prefix_cache = PrefixCache(allocator)
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self._admitted: set[int] = set()
        self._progress: dict[int, int] = {}  # tokens generated by preempted requests
        self._clock = 0.0
        self.steps = 0
        self.tokens = 0
        self.total = len(self._pending)
        self.stats = EngineStats()

    # --- clock -------------------------------------------------------------------------
    @property
    def clock(self) -> float:
        """Logical time: when the next step starts (the last one's end)."""
        return self._clock

    def idle(self) -> bool:
        """Nothing is running or waiting: the engine waits for the next arrival."""
        return not self._running and not self._waiting

    def next_step_at(self) -> float | None:
        """When the next step starts: now if there is work, else at the next arrival
        (None: nothing more will ever arrive)."""
        if not self.idle():
            return self._clock
        return max(self._clock, self._pending[0].arrival_s) if self._pending else None

    def advance(self, now: float) -> int:
        """Take every step that starts before ``now``; returns how many were taken. An
        idle engine's clock moves to ``now`` (or to the next arrival before it)."""
        taken = 0
        while self._clock < now - 1e-9:
            start = self.next_step_at()
            if start is None or start >= now - 1e-9:
                self._clock = now
                break
            self.step()
            taken += 1
        return taken

    def finished(self) -> bool:
        """Every request of the trace has been served or abandoned."""
        return self.stats.served + self.stats.abandoned == self.total

    # --- one step ----------------------------------------------------------------------
    def step(self) -> EngineSample:
        """One scheduler step, starting at :attr:`clock` (an idle engine's first moves the
        clock to the next arrival); its batch sets how long it takes."""
        if self.idle() and self._pending:
            self._clock = max(self._clock, self._pending[0].arrival_s)
        now = self._clock
        while self._pending and self._pending[0].arrival_s <= now + 1e-9:
            self._waiting.append(self._pending.popleft())
            self.stats.arrived += 1
        self._abandon(now)
        context = sum(r.tokens() for r in self._running)
        preempted, tokens = self._decode()
        admitted: list[_Running] = []
        if not preempted and self._waiting:
            budget = self.cost.max_tokens
            tokens += self._admit(None if budget is None else budget - tokens, admitted)
        self.steps += 1
        self.tokens += tokens
        self._clock = now + self.cost.seconds(tokens, context)
        for entry in admitted:  # their first token comes with the step's end
            self._first_token(entry)
        self._finish()
        self._allocator.set_running_requests(len(self._running))
        return self.sample()

    def _first_token(self, entry: _Running) -> None:
        """Record a newly admitted request's first token, or its client's leaving when its
        patience ran out while the step computed it (the request is dropped, as an engine
        aborts the request of a client that disconnected)."""
        request = entry.request
        wait = self._clock - request.arrival_s
        if self._patience_s is None or wait <= self._patience_s + 1e-9:
            self.stats.record_wait(wait, request.arrival_s)
            return
        self._running.remove(entry)
        self._release(entry)
        self.stats.abandoned += 1
        self.stats.record_wait(self._patience_s, request.arrival_s)

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

    def blocks_to_admit_next(self) -> int | None:
        """Blocks the request at the head of the queue needs to be admitted (its prompt, what
        it generated before a preemption, and its next token), or None when nobody waits."""
        return self._admission(self._waiting[0])[1] if self._waiting else None

    def _admission(self, request: Request) -> tuple[int, int]:
        """What admitting ``request`` takes: the tokens it generated before a preemption
        (it recomputes them with its prompt), and the blocks for those, its prompt and its
        next token."""
        done = self._progress.get(request.rid, 0)
        return done, self._blocks_for(request.prompt_tokens + done + 1)

    def used_blocks(self) -> int:
        """Blocks referenced by running requests (own blocks plus the shared prefix)."""
        return sum(len(r.blocks) for r in self._running) + self.prefix_cache.in_use_blocks()

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block_tokens)

    def _alloc(self, n: int, *, running: bool = False) -> list[int] | None:
        """``n`` blocks (``running``: to grow a running request), evicting own cached
        prefix blocks if that is what it takes."""
        got = self._allocator.alloc(n, running=running)
        if isinstance(got, list):
            return got
        if self.prefix_cache.evict(n):
            got = self._allocator.alloc(n, running=running)
            if isinstance(got, list):
                return got
        return None

    def _decode(self) -> tuple[bool, int]:
        """Grow every running request by one token; returns whether any was preempted,
        and the tokens decoded."""
        preempted = False
        index = 0
        while index < len(self._running):
            current = self._running[index]
            held = len(current.blocks) + current.prefix_blocks
            need = self._blocks_for(current.tokens() + 1) - held
            grown = True
            while need > 0:
                got = self._alloc(need, running=True)
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
        return preempted, index

    def _preempt(self, victim: _Running) -> None:
        self._progress[victim.request.rid] = victim.generated
        self._release(victim)
        self._waiting.appendleft(victim.request)
        self.stats.preemptions += 1

    def _release(self, entry: _Running) -> None:
        self._allocator.free(entry.blocks)
        entry.blocks = []
        if entry.request.prefix_tokens:
            self.prefix_cache.release()

    def _abandon(self, now: float) -> None:
        """Drop the queued requests whose clients ran out of patience before their first
        token. Never-admitted requests join the queue's tail in arrival order (preempted ones
        go to its head), so the oldest of them tells whether any has run out."""
        if self._patience_s is None:
            return
        cutoff = now - self._patience_s
        oldest = next((r for r in self._waiting if r.rid not in self._admitted), None)
        if oldest is None or oldest.arrival_s >= cutoff - 1e-9:
            return
        kept: deque[Request] = deque()
        for request in self._waiting:
            if request.rid in self._admitted or request.arrival_s >= cutoff - 1e-9:
                kept.append(request)
            else:
                self.stats.abandoned += 1
                self.stats.record_wait(self._patience_s, request.arrival_s)
        self._waiting = kept

    def _admit(self, budget: int | None, admitted: list[_Running]) -> int:
        """Admit waiting requests in FIFO order while their prompt blocks can be had and
        the step's token budget lasts; returns the prompt tokens computed. Requests
        admitted for the first time are appended to ``admitted``."""
        computed = 0
        while self._waiting and len(self._running) < self._max_running:
            request = self._waiting[0]
            done, needed = self._admission(request)
            full_prefix = request.prefix_tokens // self._block_tokens
            cached = self.prefix_cache.acquire() if request.prefix_tokens else 0
            cached = min(cached, full_prefix)
            prompt = request.prompt_tokens + done - cached * self._block_tokens
            if budget is not None and (budget <= 0 or (computed and computed + prompt > budget)):
                if request.prefix_tokens:
                    self.prefix_cache.release()
                break
            got = self._alloc(needed - cached)
            if got is None:
                if request.prefix_tokens:
                    self.prefix_cache.release()
                break
            if request.prefix_tokens:
                # The prefix blocks this request computed join the shared chain.
                self.prefix_cache.extend(got[: full_prefix - cached])
                got = got[full_prefix - cached :]
            self._waiting.popleft()
            self._progress.pop(request.rid, None)
            prefix = full_prefix if request.prefix_tokens else 0
            entry = _Running(request, got, prefix, generated=done + 1)
            self._running.append(entry)
            computed += prompt
            if request.rid not in self._admitted:
                self._admitted.add(request.rid)
                admitted.append(entry)
        return computed

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

        Abandoned requests count with their patience; requests never admitted so far count
        with the time they have waited until now.
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
