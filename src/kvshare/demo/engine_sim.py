"""A simulated LLM engine scheduler over a KV block allocator, stepped by a clock.

The simulation does what a vLLM-style scheduler does with KV memory, and nothing else:

- **Admission.** A request that has arrived waits in a FIFO queue until its prompt's KV
  blocks (plus the first output token) can be allocated; the head of the queue blocks the
  rest, as in vLLM. Its *queueing delay* is the time from arrival to first admission.
  Its first token comes at the end of the step that computes the last of its prompt:
  the admission step itself, unless chunked prefill spreads a long prompt over several
  steps (below). The scheduler asks the allocator whenever it has work: while the pool
  gives memory back after a reclaim, the pool itself serves only from the pages it keeps
  and says no once they are full.
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
  blocks (:class:`~kvshare.demo.blocks.PrefixCache`, the pool's ``Evictor``).

Limits (:class:`SchedulerLimits`): a step's tokens are capped (``max_tokens``, vLLM's
``max_num_batched_tokens``) and so are the requests running (``max_running``, vLLM's
``max_num_seqs``): running requests first, then admissions while the budget lasts.
Without chunked prefill the first admission of a step always goes in whole (the demo's
engine). With it, as vLLM's V1 scheduler does, a prompt that does not fit the step's
budget is computed in chunks over several steps, the running requests first in each;
its blocks are all allocated at admission (vLLM allocates them chunk by chunk: slightly
more memory is held while a long prompt is computed).

Time: what a step costs is the cost model's business (:mod:`kvshare.demo.step_cost`):
the engine describes its batch as a :class:`~kvshare.demo.step_cost.StepWork`. An engine
with nothing to do waits for the next arrival instead of stepping. :meth:`EngineSim.step`
takes one step at the engine's own time, which costs what the cost model says;
:meth:`EngineSim.begin_step` and :meth:`EngineSim.end_step` split it for a caller that
decides when a step starts and ends (the GPU twin's arbiter, which shares one device
between engines). Steps happen at logical times, so the results depend only on the
requests and on what the allocator grants, not on how promptly the caller's process was
scheduled.

Cost of simulating: a step touches only the requests something happens to (a block
boundary, a completion, an admission), found in two heaps keyed by the decode round at
which it happens; a request's generated tokens are implied by the rounds since it
joined, and the context the batch attends to is kept as a running sum.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Sequence

from kvshare.demo.blocks import BlockAllocator, PrefixCache
from kvshare.demo.engine_api import (
    EngineRequest,
    EngineSample,
    EngineStats,
    RequestObserver,
    SchedulerLimits,
)
from kvshare.demo.step_cost import CostModel, StepCost, StepWork

__all__ = [
    "BlockAllocator",
    "EngineRequest",
    "EngineSample",
    "EngineSim",
    "EngineStats",
    "PrefixCache",
    "RequestObserver",
    "SchedulerLimits",
    "StepCost",
    "StepWork",
]


class _Running:
    """A running request. Decoding, it has ``gen + round - joined`` tokens generated;
    ``left`` prompt tokens are still to compute while it is being prefilled."""

    __slots__ = (
        "blocks",
        "first",
        "gen",
        "joined",
        "left",
        "length",
        "number",
        "prefix_blocks",
        "request",
    )

    def __init__(
        self,
        number: int,
        request: EngineRequest,
        blocks: list[int],
        prefix_blocks: int,
        gen: int,
        *,
        left: int,
        length: int,
        first: bool,
    ) -> None:
        self.number = number  # admission number: its place in the running order
        self.request = request
        self.blocks = blocks  # blocks this request owns (its share of the prefix chain excluded)
        self.prefix_blocks = prefix_blocks  # full blocks of the shared prefix it references
        self.gen = gen
        self.joined = 0
        self.left = left
        self.length = length  # the prompt (and recomputed tokens) its prefill attends to
        self.first = first  # admitted for the first time: its first token is still to come

    def base(self) -> int:
        """Its tokens are ``base() + round`` while it decodes."""
        return self.request.prompt_tokens + self.gen - self.joined


class EngineSim:
    """One model's scheduler. See the module documentation for the rules it follows."""

    def __init__(
        self,
        requests: Sequence[EngineRequest],
        allocator: BlockAllocator,
        *,
        block_tokens: int,
        cost: CostModel,
        max_running: int = 256,
        patience_s: float | None = None,
        limits: SchedulerLimits | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        """``limits`` default to ``max_running`` and, for a :class:`StepCost`, its token cap."""
        if block_tokens < 1 or max_running < 1:
            raise ValueError("need block_tokens >= 1 and max_running >= 1")
        if patience_s is not None and not patience_s > 0:
            raise ValueError(
                f"patience_s must be > 0 (or None: clients wait forever), not {patience_s}"
            )
        if limits is None:
            cap = cost.max_tokens if isinstance(cost, StepCost) else None
            limits = SchedulerLimits(max_tokens=cap, max_running=max_running)
        self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self._allocator = allocator
        self._block_tokens = block_tokens
        self.cost = cost
        self.limits = limits
        self._patience_s = patience_s
        self._observer = observer
        self.prefix_cache = PrefixCache(allocator)
        self._waiting: deque[EngineRequest] = deque()
        # Running requests by admission number: insertion order is admission order, so
        # the last item is the most recently admitted (the preemption victim).
        self._running: dict[int, _Running] = {}
        self._numbers = itertools.count()
        self._round = 0  # decode passes so far
        self._decoding = 0  # running requests past their prefill
        self._base_sum = 0  # sum of base() over them: context = _base_sum + _decoding * round
        self._own_blocks = 0
        self._needs: list[tuple[int, int]] = []  # (round of the pass it needs a block in, number)
        # Entries of _needs per round (those of requests gone since included: at most).
        self._needs_in: Counter[int] = Counter()
        self._ends: list[tuple[int, int]] = []  # (round after which it is done, number)
        self._admitted: set[int] = set()
        self._progress: dict[int, int] = {}  # tokens generated by preempted requests
        self._first_token_s: dict[int, float] = {}  # of running and preempted requests
        self._step: tuple[StepWork, list[_Running]] | None = None  # begun, not ended
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
        work = self.begin_step()
        self.end_step(self._clock + self.cost.step_seconds(work))
        return self.sample()

    def begin_step(self, now: float | None = None) -> StepWork:
        """Form the batch of a step starting at ``now`` (default: :attr:`clock`, or the
        next arrival for an idle engine) and return its work; :meth:`end_step` ends it."""
        if self._step is not None:
            raise RuntimeError("a step has begun and not ended")
        if now is None:
            if self.idle() and self._pending:
                self._clock = max(self._clock, self._pending[0].arrival_s)
        else:
            self._clock = max(self._clock, now)
        now = self._clock
        while self._pending and self._pending[0].arrival_s <= now + 1e-9:
            self._waiting.append(self._pending.popleft())
            self.stats.arrived += 1
        self._abandon(now)
        context = self._base_sum + self._decoding * self._round
        preempted, decoded = self._decode()
        budget = self.limits.max_tokens
        left = None if budget is None else budget - decoded
        prefill, attended = 0, 0
        prefilled: list[_Running] = []
        if self.limits.chunked_prefill:
            prefill, attended = self._continue_prefills(left, prefilled)
        if not preempted and self._waiting:
            more, more_attended = self._admit(None if left is None else left - prefill, prefilled)
            prefill, attended = prefill + more, attended + more_attended
        work = StepWork(prefill, attended, decoded, context, sum(e.first for e in prefilled))
        self._step = (work, prefilled)
        return work

    def end_step(self, end: float) -> None:
        """End the step begun by :meth:`begin_step` at ``end``: first tokens, completions."""
        if self._step is None:
            raise RuntimeError("no step has begun")
        work, prefilled = self._step
        self._step = None
        self.steps += 1
        self.tokens += work.tokens
        self._clock = end
        for entry in prefilled:
            self._start_decoding(entry)
        for entry in prefilled:  # their first token comes with the step's end
            if entry.first:
                self._first_token(entry)
        self._finish()
        # The next decode pass is round self._round: the requests crossing into a new
        # block by then take one each (a shrinking pool keeps empty pages for those only).
        # Its keys are the next block_tokens rounds or so: the sum is cheap.
        upcoming = sum(n for crossing, n in self._needs_in.items() if crossing <= self._round)
        self._allocator.expect_blocks(upcoming)

    def _first_token(self, entry: _Running) -> None:
        """Record a newly admitted request's first token, or its client's leaving when its
        patience ran out while the step computed it (the request is dropped, as an engine
        aborts the request of a client that disconnected)."""
        request = entry.request
        wait = self._clock - request.arrival_s
        if self._patience_s is None or wait <= self._patience_s + 1e-9:
            self.stats.record_wait(wait, request.arrival_s)
            self._first_token_s[request.rid] = self._clock
            if self._observer is not None:
                self._observer.first_token(request, self._clock)
            return
        self._remove(entry)
        self.stats.abandoned += 1
        self.stats.record_wait(self._patience_s, request.arrival_s)
        if self._observer is not None:
            self._observer.gave_up(request, self._clock)

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

    def _admission(self, request: EngineRequest) -> tuple[int, int]:
        """What admitting ``request`` takes: the tokens it generated before a preemption
        (it recomputes them with its prompt), and the blocks for those, its prompt and its
        next token."""
        done = self._progress.get(request.rid, 0)
        return done, self._blocks_for(request.prompt_tokens + done + 1)

    def overdue(self, cutoff_s: float) -> int:
        """Requests that arrived before ``cutoff_s`` and were never admitted (queued, or
        not yet taken in because a step or the GPU kept the engine busy)."""
        count = 0
        for request in self._waiting:
            if request.rid in self._admitted:
                continue
            if request.arrival_s >= cutoff_s:
                return count
            count += 1
        for request in self._pending:
            if request.arrival_s >= cutoff_s:
                break
            count += 1
        return count

    def used_blocks(self) -> int:
        """Blocks referenced by running requests (own blocks plus the shared prefix)."""
        return self._own_blocks + self.prefix_cache.in_use_blocks()

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

    # --- running requests ------------------------------------------------------------------
    def _start_decoding(self, entry: _Running) -> None:
        """A request whose prompt is computed decodes from the next step on."""
        entry.joined = self._round
        self._decoding += 1
        self._base_sum += entry.base()
        self._expect_block(entry)
        finish = entry.request.output_tokens - entry.gen + entry.joined
        heapq.heappush(self._ends, (finish, entry.number))

    def _expect_block(self, entry: _Running) -> None:
        """Note the decode round in which ``entry`` next crosses into a new block."""
        held = len(entry.blocks) + entry.prefix_blocks
        base = entry.request.prompt_tokens + entry.gen - entry.joined
        crossing = held * self._block_tokens - base
        heapq.heappush(self._needs, (crossing, entry.number))
        self._needs_in[crossing] += 1

    def _decode(self) -> tuple[bool, int]:
        """Grow every decoding request by one token; returns whether any was preempted,
        and the tokens decoded. Only the requests that cross into a new block in this
        round are visited, in admission order."""
        now = self._round
        due: list[int] = []
        while self._needs and self._needs[0][0] <= now:
            crossing, number = heapq.heappop(self._needs)
            due.append(number)
            self._needs_in[crossing] -= 1
            if not self._needs_in[crossing]:
                del self._needs_in[crossing]
        due.sort()
        preempted = False
        for number in due:
            current = self._running.get(number)
            if current is None:  # preempted earlier in this round
                continue
            held = len(current.blocks) + current.prefix_blocks
            need = self._blocks_for(current.base() + now + 1) - held
            grown = True
            while need > 0:
                got = self._alloc(need, running=True)
                if got is not None:
                    current.blocks.extend(got)
                    self._own_blocks += len(got)
                    break
                _, victim = self._running.popitem()
                self._preempt(victim)
                preempted = True
                if victim is current:
                    grown = False
                    break
            if grown:
                self._expect_block(current)
        self._round = now + 1
        return preempted, self._decoding

    def _preempt(self, victim: _Running) -> None:
        """``victim`` (already out of the running set) goes back to the queue's head. (It
        is decoding unless its prompt is still being computed in chunks: preemption
        happens before a step's admissions, after the last step's prefills started to
        decode.)"""
        if victim.left:
            generated = victim.gen - 1  # what it had before this admission; it recomputes
        else:
            generated = victim.gen + self._round - victim.joined
            self._decoding -= 1
            self._base_sum -= victim.base()
        self._progress[victim.request.rid] = generated
        self._release(victim)
        self._waiting.appendleft(victim.request)
        self.stats.preemptions += 1

    def _remove(self, entry: _Running) -> None:
        """Take a decoding ``entry`` out of the running set and free its blocks."""
        del self._running[entry.number]
        self._decoding -= 1
        self._base_sum -= entry.base()
        self._release(entry)

    def _release(self, entry: _Running) -> None:
        self._allocator.free(entry.blocks)
        self._own_blocks -= len(entry.blocks)
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
        kept: deque[EngineRequest] = deque()
        for request in self._waiting:
            if request.rid in self._admitted or request.arrival_s >= cutoff - 1e-9:
                kept.append(request)
            else:
                self.stats.abandoned += 1
                self.stats.record_wait(self._patience_s, request.arrival_s)
                if self._observer is not None:
                    self._observer.gave_up(request, now)
        self._waiting = kept

    def _continue_prefills(self, budget: int | None, prefilled: list[_Running]) -> tuple[int, int]:
        """The next chunks of the prompts being computed, within ``budget``."""
        computed, attended = 0, 0
        for entry in self._running.values():
            if not entry.left:
                continue
            room = entry.left if budget is None else min(entry.left, budget - computed)
            if room <= 0:
                break
            entry.left -= room
            computed += room
            attended += room * entry.length
            if not entry.left:
                prefilled.append(entry)
        return computed, attended

    def _admit(self, budget: int | None, prefilled: list[_Running]) -> tuple[int, int]:
        """Admit waiting requests in FIFO order while their prompt blocks can be had and
        the step's token budget lasts; returns the prompt tokens computed and their
        attended length (see :class:`StepWork`). Admitted requests whose whole prompt is
        computed in this step are appended to ``prefilled``."""
        computed, attended = 0, 0
        chunked = self.limits.chunked_prefill
        while self._waiting and len(self._running) < self.limits.max_running:
            request = self._waiting[0]
            done, needed = self._admission(request)
            full_prefix = request.prefix_tokens // self._block_tokens
            cached = self.prefix_cache.acquire() if request.prefix_tokens else 0
            cached = min(cached, full_prefix)
            prompt = max(1, request.prompt_tokens + done - cached * self._block_tokens)
            chunk = prompt
            if budget is not None:
                if chunked:
                    chunk = min(prompt, budget - computed)
                    refuse = chunk <= 0
                else:
                    refuse = budget <= 0 or bool(computed and computed + prompt > budget)
                if refuse:
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
            length = request.prompt_tokens + done
            # Its first token is still to come unless it streamed one before a preemption.
            first = request.rid not in self._first_token_s
            number = next(self._numbers)
            entry = _Running(
                number,
                request,
                got,
                prefix,
                done + 1,
                left=prompt - chunk,
                length=length,
                first=first,
            )
            self._running[number] = entry
            self._own_blocks += len(got)
            self._admitted.add(request.rid)
            computed += chunk
            attended += chunk * length
            if not entry.left:
                prefilled.append(entry)
        return computed, attended

    def _finish(self) -> None:
        """Serve the requests that produced their last token in this step, in admission
        order."""
        done: list[int] = []
        while self._ends and self._ends[0][0] <= self._round:
            done.append(heapq.heappop(self._ends)[1])
        done.sort()
        for number in done:
            entry = self._running.get(number)
            if entry is None:
                continue
            self._remove(entry)
            self.stats.served += 1
            first = self._first_token_s.pop(entry.request.rid, self._clock)
            if self._observer is not None:
                self._observer.finished(entry.request, first, self._clock)

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
        for entry in self._running.values():
            self._release(entry)
        self._running = {}
        self._decoding = self._base_sum = 0
        self.prefix_cache.evict(self.prefix_cache.cached_blocks())
