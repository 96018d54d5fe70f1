"""The broker's policy: who gets memory, what is reclaimed from whom, and when.

The books (:mod:`kvshare.deviceplugin.broker.books`) keep the accounts and the invariants: no
grant ever takes more than the GPU's unleased memory, and reclaimed memory stays charged
to its pool until the pool reports that it released it. Within those rules the books ask
a :class:`Policy` three questions:

- :meth:`Policy.ask` — how far to grow a pool that asks for more, given that pool alone
  (:class:`PoolState`): asked on every ask, the broker's hot path, so it never sees the
  whole GPU. The books grant it as far as unleased memory (less what a waiting start-up
  turn needs) allows; whatever is missing is then the business of the two questions below.
- :meth:`Policy.grants` — with a frozen snapshot of one GPU (:class:`GpuState`), which
  waiting pools to grow now, to what, in what order: asked whenever memory came free or a
  report moved while pools wait. The books apply each grant in order, as far as unleased
  memory allows, and never beyond what the pool may hold (its kv max; its floor on a GPU
  that is draining or unhealthy).
- :meth:`Policy.reclaims` — with the same snapshot, which pools to ask for memory back,
  and down to what: asked after every change that may leave a pool waiting. The books
  send each reclaim whose target is below the pool's lease (raised to the pool's floor
  and page-aligned), and skip pools that missed a reclaim's deadline. A reclaim to a
  pool that is still releasing an earlier one lowers its target.

A policy holds no books of its own and mutates nothing it is given; it may keep its own
estimates (of demand, say) keyed by pool id.

:data:`POLICIES` names every policy the node agent can run (``kvshare node
--broker-policy``); :class:`Entitlement` is its default (:data:`DEFAULT_POLICY`),
:class:`FairShare` the policy before it. ``python -m kvshare.demo.elastic_sim`` runs them
against the trace suite in simulated time, and ``bench/run.py elastic-suite`` with real
processes.

Entitlement
-----------
Every pool is *entitled* to a weighted equal share of the GPU (weight ``priority + 1``,
at least its floor): what it gets back whatever the others need. Memory is lent freely;
what is taken back, and from whom, follows from what comes back fast and what does not:

- *idle lease* (what a pool does not use, its ready pages and its prefix cache included:
  a quiet vLLM server keeps every freed block as prefix cache until it needs room, and
  the pool evicts them as soon as its lease is lowered) comes back within a round trip,
  so it is taken from any pool that is not short for any pool that is — except what a
  pool asked for a moment ago (it may not have reported using it yet), and, below
  its entitlement, any headroom above what it uses that the policy is set to keep
  (``headroom_share`` of its entitlement; none by default, see below);
- *memory in use* comes back only as its requests finish, so it is taken only for a pool
  below its entitlement, and only from pools above theirs, down to no less than their
  entitlement: pools that both hold their share do not churn each other's blocks. Of
  those, pools that are not short themselves give first: a lowered lease holds a pool's
  queue until it has shrunk, and a pool with a queue would make its own requests wait
  for memory another borrower could give without making anyone wait.
- An ask outlives the need (pools never say they want less): a pool still short says so
  again every half second, and an ask not heard again for ``fresh_s`` (1 s) no longer
  counts. The sooner an ask lapses, the sooner memory a pool asked for and then did not
  use goes where it is needed: in simulated time (``python -m kvshare.demo.elastic_sim
  --seeds 6``, 30 traces) asks lapsing after 1 s captured 0.53 of the available gain on
  average, 0.46 when they lapsed after 1.5 s, with as few traces (4) leaving a tenant
  below 0.9 of its due (measured before a shrinking pool let running requests grow into
  its emptied and retired pages; with that, 1 s gives 0.62 and 2 such traces).

- Headroom keeps idle memory with every quiet pool below its entitlement, so that its
  next requests start at once rather than after a reclaim from a busy pool, whose memory
  in use comes back only as its requests finish. Every quiet pool keeps it, so together
  they keep a lot, and at the SLO, where platforms run, it cost more capacity than it
  saved. In the GPU twin on an H200 (``docs/twin.md``), on 20 workloads the capacity
  suite does not hold (seeds 3 and 4 of every family), with asks of 32 MiB: no headroom
  reached 0.96-1.01 of first-come's capacity (median 0.994), a twentieth of an
  entitlement 0.96-1.00 (median 0.987, 15 of the workloads), and the old default (a
  tenth, with asks of 256 MiB) 0.94-0.99 (median 0.975). In permanent overload
  (``python -m kvshare.demo.elastic_sim --seeds 6 --paged-bound [--headroom-share H]``,
  30 traces) no headroom captures the same share of the gain (mean 0.64, median 0.70
  against 0.67) with fewer traces leaving a tenant below 0.9 of its due (2 against 3),
  but on one (dominant-2) a quiet tenant gets 0.32 of its due, against 0.64 with a
  tenth: headroom guards a quiet tenant in overload, paid for by every workload at the
  SLO. One reserve for the whole GPU instead (a tenth of the mean entitlement kept
  unleased for the pools below their entitlement) did worse on both counts: 0.95 and
  0.96 of first-come on the two fleet-onoff 8B workloads above (against 0.99 and
  0.96), and 6 overload traces with a tenant below 0.9 (worst 0.63). Earlier, swept
  with the pools' reserve of ready pages (then 4 pages by default, whatever a page held;
  now the pages that hold 4 blocks) in overload only (reserve 1, 2, 4; headroom
  0.1-0.3), no setting beat a reserve of 4 pages.

- Where the rest of the gain goes (pages, and with one-block pages fragments of idle
  lease in every short pool), and the rules tried in this policy's place that did worse:
  docs/demo.md, "Where the rest of the gain goes, and what did worse".

Measured against :class:`FairShare` on the trace suite (``bench/run.py elastic-suite``,
``python -m kvshare.demo.elastic_sim``), it gains more of what sharing allows and keeps
quiet tenants near their static service; the numbers are in BENCHMARKS.md.

FairShare
---------
- Growth is granted on demand from unleased memory, page-aligned, up to ``kv_max``.
- Fair shares are a weighted max-min split of the budget (weight ``priority + 1``, each
  pool between its *floor* — ``kv_min``, and at least the page that holds its null block,
  which a pool never releases — and its demand: what it uses, or what it asks for while it
  waits). Memory that comes free goes to waiters below their fair share first (highest
  priority, then longest waiting), then to the others. A pool below its fair share that
  cannot grow makes the broker reclaim, in one round, everything it and the other waiters
  are short of:

  1. *idle lease* first: lease above what a pool that is not waiting holds or uses. The
     pool gives it back at once (it only lowers its limit and drops ready pages), so the
     waiter gets it within a round trip;
  2. then memory held above a fair share, lowest priority first, each pool down to no
     less than its fair share and its floor. Blocks in use count: the pool stops
     placing new blocks in the pages it gives up and releases them as their requests
     finish (the runtime's pool does), so a pool with a backlog cannot keep more than its
     share.

  A pool that is still releasing an earlier reclaim can be asked for more when the
  waiters need more (the reclaim is re-issued with a lower target); otherwise it would
  go on filling the rest of its lease until it had released the first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Entitlement",
    "FairShare",
    "GpuState",
    "Policy",
    "PoolState",
    "fair_shares",
    "policy_named",
]


@dataclass(frozen=True, slots=True)
class PoolState:
    """One pool, as a policy sees it (bytes)."""

    id: int
    priority: int
    """Higher keeps memory longer (lower gives memory back first)."""
    page: int
    """Every lease is a multiple of it."""
    floor: int
    """The least the pool is ever taken down to: its kv min, and at least the page of its
    null block."""
    kv_max: int | None
    want: int
    """What the pool last asked its lease to reach (within its kv max)."""
    cap: int
    """What it asks to grow to now: its want, or at most its floor on a GPU that is
    draining or unhealthy."""
    lease: int
    charge: int
    """What the books count as taken for it: at least its lease and its floor, and what it
    may still hold of a reclaim."""
    held: int
    """Physical memory it last reported holding (mapped and reserved pages)."""
    used: int
    """Of that, in blocks in use."""
    cached: int
    """Of that, in blocks kept only as prefix cache (evictable)."""
    waiting_since: float | None
    """Since when it has waited for more than its lease (None: not waiting)."""
    wanted_at: float | None
    """When it last asked for more (a pool still short says so again every half
    second)."""
    reclaim_target: int | None
    """The target of its unacknowledged reclaim, if any."""
    reclaim_overdue: bool
    """Its reclaim missed the deadline (the books ask it for nothing more)."""

    @property
    def active(self) -> int:
        """Memory in blocks that requests hold: what it uses less its prefix cache, which
        the pool evicts as soon as its lease is lowered."""
        return max(0, self.used - self.cached)

    @property
    def waiting(self) -> bool:
        """It asks for more than its lease, and no reclaim of it is pending."""
        return self.reclaim_target is None and self.cap > self.lease


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU, as a policy sees it (bytes)."""

    now: float
    """The books' clock (monotonic seconds)."""
    budget: int
    """What the broker may lend: total - headroom - static footprints."""
    unleased: int
    """Budget less every charge: what grants may take now."""
    turn_need: int
    """What the next engine waiting for the start-up turn needs (grants leave it)."""
    reserved: int
    """Charged outside the pools (the kv min reserved for an engine's start-up turn)."""
    draining: bool
    pools: tuple[PoolState, ...]

    def waiters(self) -> list[PoolState]:
        """The pools waiting for more."""
        return [p for p in self.pools if p.waiting]


class Policy(Protocol):
    """Decides who gets memory and what is reclaimed (see the module doc)."""

    name: str

    def ask(self, pool: PoolState) -> int:
        """The lease to grow ``pool`` to now that it asks for more."""

    def grants(self, gpu: GpuState) -> list[tuple[int, int]]:
        """``(pool id, lease target)`` pairs to grow among the waiting pools, in order."""

    def reclaims(self, gpu: GpuState) -> dict[int, int]:
        """Pool id -> the lease to reclaim it down to."""

    def waiting_for(self, gpu: GpuState) -> dict[int, int]:
        """Pool id -> bytes it asks for beyond its lease, for the pools whose asks the
        policy reclaims for now: what reclaims for waiters are for (empty: a reclaim made
        only for waiters is no longer needed)."""


def fair_shares(capacity: int, pools: Iterable[tuple[int, int, int, int]]) -> dict[int, int]:
    """Weighted max-min fair split of ``capacity`` bytes.

    ``pools`` yields ``(id, floor, demand, weight)``. Each pool gets at least its floor,
    never more than its demand (when demand >= floor), and what is left is divided in
    proportion to the weights, re-dividing what capped pools leave over.
    """
    entries = list(pools)
    share = {pid: floor for pid, floor, _, _ in entries}
    remaining = capacity - sum(share.values())
    active = [(pid, demand, weight) for pid, floor, demand, weight in entries if demand > floor]
    while remaining > 0 and active:
        total_weight = sum(weight for _, _, weight in active)
        capped = [
            (pid, demand)
            for pid, demand, weight in active
            if share[pid] + remaining * weight // total_weight >= demand
        ]
        if not capped:
            for pid, _, weight in active:
                share[pid] += remaining * weight // total_weight
            break
        for pid, demand in capped:
            remaining -= demand - share[pid]
            share[pid] = demand
        done = {pid for pid, _ in capped}
        active = [entry for entry in active if entry[0] not in done]
    return share


def _align_up(value: int, page: int) -> int:
    return -(-value // page) * page


def _overcommitted(gpu: GpuState, targets: dict[int, int]) -> None:
    """Lower ``targets`` until the GPU is back within its budget, lowest priority first,
    each pool to no less than its floor: idle memory of every pool first, then memory in
    use. Only for what the policy's own passes left over-committed (after a restart with
    a smaller budget: raised headroom, a smaller configuration, a GPU reported smaller)."""
    excess = -gpu.unleased - _incoming(gpu)
    excess -= sum(p.lease - targets.get(p.id, p.lease) for p in gpu.pools)
    if excess <= 0:
        return
    order = sorted(
        (p for p in gpu.pools if not p.reclaim_overdue),
        key=lambda p: (p.priority, -(targets.get(p.id, p.lease) - p.active), p.id),
    )
    for in_use in (False, True):
        for pool in order:
            if excess <= 0:
                return
            target = targets.get(pool.id, pool.lease)
            keep = _align_up(pool.floor if in_use else max(pool.floor, pool.active), pool.page)
            take = min(target - keep, _align_up(excess, pool.page))
            if take > 0:
                targets[pool.id] = target - take
                excess -= take


class FairShare:
    """Weighted max-min fair shares of measured demand, idle lease reclaimed first (see
    the module doc)."""

    name = "fair-share"

    def shares(self, gpu: GpuState) -> dict[int, int]:
        """Each pool's fair share of the GPU now."""
        if gpu.draining:
            return {p.id: p.floor for p in gpu.pools}
        capacity = gpu.budget - gpu.turn_need - gpu.reserved
        entries = []
        for p in gpu.pools:
            # Demand is what the pool uses, or what it asks for while it waits; leases it
            # does not use (and prefix cache it could evict) do not count.
            waiting = p.want if p.want > p.lease else 0
            demand = max(p.floor, p.used, waiting)
            if p.kv_max is not None:
                demand = min(demand, max(p.kv_max, p.floor))
            entries.append((p.id, p.floor, demand, p.priority + 1))
        return fair_shares(capacity, entries)

    def ask(self, pool: PoolState) -> int:
        return pool.cap

    def grants(self, gpu: GpuState) -> list[tuple[int, int]]:
        waiters = gpu.waiters()
        if not waiters:
            return []
        fair = self.shares(gpu)
        order = sorted(
            waiters,
            key=lambda p: (
                p.lease >= fair[p.id],
                -p.priority,
                p.waiting_since or gpu.now,
                p.id,
            ),
        )
        # Up to the fair share first, then whatever is left, in the same order.
        capped = [(p.id, min(p.cap, max(fair[p.id], p.lease))) for p in order]
        return capped + [(p.id, p.cap) for p in order]

    def reclaims(self, gpu: GpuState) -> dict[int, int]:
        fair = self.shares(gpu)
        waiters = gpu.waiters()
        shortfall = gpu.turn_need
        for pool in waiters:
            entitled = min(pool.cap, max(fair[pool.id], pool.floor))
            shortfall += max(0, entitled - pool.lease)
        incoming = _incoming(gpu)
        # Idle lease is taken for everything the waiters are short of, even what pending
        # reclaims will bring: it costs its holder nothing and comes back at once, while
        # memory in use comes back only as its requests finish.
        idle_need = shortfall - gpu.unleased
        need = idle_need - incoming
        if idle_need <= 0 and gpu.unleased >= 0:
            return {}
        # Never below a pool's fair share or its floor. Pools still releasing a reclaim can
        # be asked for more; those past its deadline are left alone.
        floors = {p.id: _align_up(max(fair[p.id], p.floor), p.page) for p in gpu.pools}
        victims = sorted(
            (p for p in gpu.pools if not p.reclaim_overdue and p.lease > floors[p.id]),
            key=lambda p: (p.priority, -(p.held - p.used), -(p.lease - floors[p.id]), p.id),
        )
        waiting = {p.id for p in waiters}
        targets = {p.id: p.lease for p in victims}
        # Pass 1, idle lease: what pools that are not waiting neither hold nor use.
        for victim in victims:
            if idle_need <= 0:
                break
            if victim.id in waiting or victim.reclaim_target is not None:
                continue  # a pool already giving back idle memory is not asked again
            keep = max(floors[victim.id], _align_up(max(victim.held, victim.used), victim.page))
            take = min(targets[victim.id] - keep, _align_up(idle_need, victim.page))
            if take > 0:
                targets[victim.id] -= take
                idle_need -= take
                need -= take
        # Pass 2, memory held above a fair share (blocks in use included).
        for victim in victims:
            if need <= 0:
                break
            take = min(targets[victim.id] - floors[victim.id], _align_up(need, victim.page))
            if take > 0:
                targets[victim.id] -= take
                need -= take
        _overcommitted(gpu, targets)
        return {p.id: t for p in gpu.pools if (t := targets.get(p.id, p.lease)) < p.lease}

    def waiting_for(self, gpu: GpuState) -> dict[int, int]:
        return {p.id: p.cap - p.lease for p in gpu.waiters()}


def _incoming(gpu: GpuState) -> int:
    """What the reclaims still pending (and within their deadline) will bring back."""
    return sum(
        max(0, p.charge - max(p.floor, p.reclaim_target))
        for p in gpu.pools
        if p.reclaim_target is not None and not p.reclaim_overdue
    )


class Entitlement:
    """Lend what is idle; take memory in use back only for a pool below its entitlement
    (see the module doc)."""

    name = "entitlement"

    def __init__(self, *, fresh_s: float = 1.0, headroom_share: float = 0.0) -> None:
        if not 0 <= headroom_share <= 1:
            raise ValueError(f"headroom share must be within 0-1, not {headroom_share}")
        self.fresh_s = fresh_s
        self.headroom_share = headroom_share

    def fresh(self, pool: PoolState, now: float) -> bool:
        """Whether the pool's ask still stands. An ask outlives the need: a pool still
        short says so again every half second, so an ask not heard again for ``fresh_s``
        is one the pool no longer needs."""
        return pool.wanted_at is not None and now - pool.wanted_at <= self.fresh_s

    def short(self, pool: PoolState, now: float) -> bool:
        """Whether the pool waits for more: it asks for more than its lease, freshly."""
        return pool.waiting and self.fresh(pool, now)

    def entitlements(self, gpu: GpuState) -> dict[int, int]:
        """Each pool's weighted equal share of what the pools may hold (at least its
        floor): what it gets back whatever the others need."""
        capacity = gpu.budget - gpu.turn_need - gpu.reserved
        total = sum(p.priority + 1 for p in gpu.pools) or 1
        return {
            p.id: _align_up(max(p.floor, capacity * (p.priority + 1) // total), p.page)
            for p in gpu.pools
        }

    def ask(self, pool: PoolState) -> int:
        return pool.cap

    def grants(self, gpu: GpuState) -> list[tuple[int, int]]:
        entitled = self.entitlements(gpu)
        waiters = sorted(
            (p for p in gpu.pools if self.short(p, gpu.now)),
            key=lambda p: (
                p.lease >= entitled[p.id],
                -p.priority,
                p.waiting_since or gpu.now,
                p.id,
            ),
        )
        # Up to the entitlement first, then what each asked, in the same order.
        first = [(p.id, min(p.cap, max(entitled[p.id], p.lease))) for p in waiters]
        return first + [(p.id, p.cap) for p in waiters]

    def waiting_for(self, gpu: GpuState) -> dict[int, int]:
        return {p.id: p.cap - p.lease for p in gpu.pools if self.short(p, gpu.now)}

    def reclaims(self, gpu: GpuState) -> dict[int, int]:
        if gpu.draining:
            return {p.id: p.floor for p in gpu.pools if p.lease > p.floor}
        entitled = self.entitlements(gpu)
        short = [p for p in gpu.pools if self.short(p, gpu.now)]
        # Idle lease is taken for everything short pools ask: it costs its holder nothing
        # and comes back within a round trip.
        idle_need = gpu.turn_need + sum(p.cap - p.lease for p in short) - gpu.unleased
        # Memory in use comes back only as its requests finish, and only for a pool below
        # its entitlement (and an engine waiting to start).
        owed = sum(max(0, min(p.cap, entitled[p.id]) - p.lease) for p in short)
        busy_need = gpu.turn_need + owed - gpu.unleased - _incoming(gpu)
        if idle_need <= 0 and busy_need <= 0 and gpu.unleased >= 0:
            return {}
        leases = {p.id: p.lease for p in gpu.pools}
        targets = {p.id: p.lease for p in gpu.pools if not p.reclaim_overdue}
        short_ids = {p.id for p in short}
        # Pass 1, idle lease of the pools that are not short, lowest priority and most idle
        # first: each keeps what it uses (its ready pages are idle too), what it asked for
        # a moment ago (it may not have reported using it yet), and below its entitlement
        # headroom for its next requests, so that they start at once rather than after a
        # reclaim from a busy pool. A pool already giving back is not asked for more idle
        # memory before it has answered: its report may not show the first reclaim yet,
        # and asking again would take its cache for memory nobody takes.
        idle = sorted(
            (
                p
                for p in gpu.pools
                if p.id in targets and p.id not in short_ids and p.reclaim_target is None
            ),
            key=lambda p: (p.priority, -(p.lease - p.active), p.id),
        )
        for pool in idle:
            if idle_need <= 0:
                break
            keep = max(pool.floor, pool.active)
            if self.fresh(pool, gpu.now):
                keep = max(keep, min(pool.lease, pool.want))
            if pool.lease <= entitled[pool.id]:
                headroom = int(entitled[pool.id] * self.headroom_share)
                keep = max(keep, min(entitled[pool.id], pool.active + headroom))
            keep = _align_up(keep, pool.page)
            take = min(targets[pool.id] - keep, _align_up(idle_need, pool.page))
            if take > 0:
                targets[pool.id] -= take
                idle_need -= take
                busy_need -= take
        # Pass 2, memory held above an entitlement, lowest priority first; among equals
        # the pools that are not short themselves first, then the most above. A lowered
        # lease stops a pool's admissions until it has shrunk to it: a pool with nothing
        # waiting gives back as its requests finish and makes no one wait, while a short
        # one's queue would wait for the whole release as well.
        borrowers = sorted(
            (p for p in gpu.pools if p.id in targets and targets[p.id] > entitled[p.id]),
            key=lambda p: (p.priority, p.id in short_ids, -(targets[p.id] - entitled[p.id]), p.id),
        )
        for pool in borrowers:
            if busy_need <= 0:
                break
            keep = max(entitled[pool.id], _align_up(pool.floor, pool.page))
            take = min(targets[pool.id] - keep, _align_up(busy_need, pool.page))
            if take > 0:
                targets[pool.id] -= take
                busy_need -= take
        _overcommitted(gpu, targets)
        return {pid: t for pid, t in targets.items() if t < leases[pid]}


#: Every policy the node agent can run, by name.
POLICIES: dict[str, type[FairShare] | type[Entitlement]] = {
    FairShare.name: FairShare,
    Entitlement.name: Entitlement,
}


#: The policy the node agent runs unless told otherwise.
DEFAULT_POLICY = Entitlement.name


def policy_named(name: str) -> Policy:
    """A fresh instance of the policy called ``name``; ValueError names the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown broker policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
