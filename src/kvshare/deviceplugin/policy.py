"""The broker's policy: who gets memory, what is reclaimed from whom, and when.

The books (:mod:`kvshare.deviceplugin.books`) keep the accounts and the invariants: no
grant ever takes more than the GPU's unleased memory, and reclaimed memory stays charged
to its pool until the pool reports that it released it. Within those rules the books ask
a :class:`Policy` two questions, each with a frozen snapshot of one GPU
(:class:`GpuState`):

- :meth:`Policy.grants` — which pools to grow now, to what, in what order. Asked when a
  pool asks for more (``asking`` is its id) and whenever memory came free (``asking`` is
  None: serve whoever waits). The books apply each grant in order, as far as unleased
  memory (less what a waiting start-up turn needs) allows, and never beyond what the pool
  may hold (its kv max; its floor on a GPU that is draining or unhealthy).
- :meth:`Policy.reclaims` — which pools to ask for memory back, and down to what. Asked
  after every change that may leave a pool waiting. The books send each reclaim whose
  target is below the pool's lease (raised to the pool's floor and page-aligned), and
  skip pools that missed a reclaim's deadline. A reclaim to a pool that is still
  releasing an earlier one lowers its target.

A policy holds no books of its own and mutates nothing it is given; it may keep its own
estimates (of demand, say) keyed by pool id.

:class:`FairShare` is the default policy (below); :data:`POLICIES` names every policy the
node agent can run (``kvshare node --broker-policy``).

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

__all__ = ["POLICIES", "FairShare", "GpuState", "Policy", "PoolState", "fair_shares", "policy"]


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
    reclaim_target: int | None
    """The target of its unacknowledged reclaim, if any."""
    reclaim_overdue: bool
    """Its reclaim missed the deadline (the books ask it for nothing more)."""

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

    def grants(self, gpu: GpuState, asking: int | None) -> list[tuple[int, int]]:
        """``(pool id, lease target)`` pairs to grow, in order."""

    def reclaims(self, gpu: GpuState) -> dict[int, int]:
        """Pool id -> the lease to reclaim it down to."""


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

    def grants(self, gpu: GpuState, asking: int | None) -> list[tuple[int, int]]:
        if asking is not None:
            pool = next(p for p in gpu.pools if p.id == asking)
            return [(pool.id, pool.cap)]
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
        incoming = 0
        for pool in gpu.pools:
            if pool.reclaim_target is not None and not pool.reclaim_overdue:
                incoming += max(0, pool.charge - max(pool.floor, pool.reclaim_target))
        # Idle lease is taken for everything the waiters are short of, even what pending
        # reclaims will bring: it costs its holder nothing and comes back at once, while
        # memory in use comes back only as its requests finish.
        idle_need = shortfall - gpu.unleased
        need = idle_need - incoming
        if idle_need <= 0:
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
            if victim.id in waiting:
                continue
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
        return {p.id: targets[p.id] for p in victims if targets[p.id] < p.lease}


#: Every policy the node agent can run, by name.
POLICIES: dict[str, type[FairShare]] = {FairShare.name: FairShare}


def policy(name: str) -> Policy:
    """A fresh instance of the policy called ``name``; ValueError names the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown broker policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
