"""A budget that shrinks under running pools: the agent restarts with a raised headroom, a
smaller configuration or a GPU reported smaller, and the pools re-declare more than the
new budget. The real books and policies, on a simulated clock."""

from __future__ import annotations

import pytest

from kvshare.api.wire import Hello, Report
from kvshare.deviceplugin.broker.books import Books, ExpectedPool, Send
from kvshare.deviceplugin.broker.policy import POLICIES, policy_named
from kvshare.deviceplugin.inventory import GpuInfo

from .test_books import leases, reclaims

MIB = 2**20
GIB = 2**30
PAGE = 256 * 2**10
DEADLINE_S = 5.0


def hello(pod: str, priority: int, held: int, used: int) -> Hello:
    return Hello(
        version=1, gpu="GPU-shrink-0", page_size=PAGE, kv_min=4 * MIB, kv_max=None,
        priority=priority, static=0, namespace="ns", pod=pod, resume=True, held=held,
        used=used, lease=held,
    )  # fmt: skip


def restarted(
    budget: int, policy: str = "entitlement", gpu_bytes: int = GIB, sized_for: int = GIB
) -> Books:
    """The books of an agent restarted with ``budget`` to lend, expecting pools a and b of
    the previous one (their engines sized their KV caches for ``sized_for``)."""
    gpu = GpuInfo(uuid="GPU-shrink-0", index=0, name="test", total_bytes=gpu_bytes)
    expected = [
        ExpectedPool(pid=10 + i, name=f"ns/{pod}", gpu=gpu.uuid, static=0, kv_min=4 * MIB,
                     gpu_total=sized_for)
        for i, pod in enumerate("ab")
    ]  # fmt: skip
    return Books(
        [gpu],
        headroom=gpu_bytes - budget,
        reclaim_deadline_s=DEADLINE_S,
        expected=expected,
        recovery_deadline=30.0,
        policy=policy_named(policy),
    )


def redeclare(books: Books, held: int, used: dict[str, int]) -> tuple[dict[str, int], list[Send]]:
    """Both pools re-declare ``held`` bytes (``used`` of them in use, by pod); their ids
    and what the books send once both are back."""
    ids, sends = {}, []
    for i, (pod, priority) in enumerate((("a", 50), ("b", 200))):
        admission = books.admit(hello(pod, priority, held, used[pod]), 10 + i, 1.0)
        assert admission.record is not None, admission.reason
        ids[pod] = admission.record.id
        sends += admission.sends
    return ids, sends


def release(books: Books, ids: dict[str, int], sends: list[Send], used: dict[str, int]) -> None:
    """Each reclaimed pool evicts its cache and reports what is left, acknowledging."""
    for pod, pool in ids.items():
        asked = reclaims(sends).get(pool)
        if asked is not None:
            held = max(asked.limit, used[pod])
            books.report(pool, Report(held, used[pod], 0, 0, ack=asked.seq), 1.5)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_halved_budget_is_reached_lowest_priority_first_never_below_a_minimum(
    policy: str,
) -> None:
    books = restarted(budget=16 * MIB, policy=policy)
    used = {"a": 2 * MIB, "b": 6 * MIB}
    ids, sends = redeclare(books, 16 * MIB, used)
    assert books.view(1.0).gpus[0].overcommitted == 16 * MIB
    asked = {pod: reclaims(sends)[pool].limit for pod, pool in ids.items()}
    assert all(limit >= 4 * MIB for limit in asked.values())  # never below a minimum
    assert asked["a"] <= asked["b"]  # the lower priority gives back more
    assert sum(asked.values()) <= 16 * MIB
    # Every reclaim is due within one deadline, and the pools' blocks in use fit.
    assert all(r.deadline_s <= DEADLINE_S for r in reclaims(sends).values())
    release(books, ids, sends, used)
    gpu = books.view(1.5).gpus[0]
    assert gpu.kv_charged <= 16 * MIB and gpu.overcommitted == 0 and gpu.min_shortfall == 0
    books.check()


def test_after_a_shrink_a_burst_takes_idle_memory_from_the_other_pool() -> None:
    books = restarted(budget=16 * MIB)
    used = {"a": 2 * MIB, "b": 2 * MIB}
    ids, sends = redeclare(books, 16 * MIB, used)
    release(books, ids, sends, used)
    a, b = ids["a"], ids["b"]
    before = books.pool(a).lease  # type: ignore[union-attr]
    # B is quiet, its lease full of idle memory; A's requests outgrow its lease.
    books.report(b, Report(books.pool(b).lease, 2 * MIB, 0, 0), 2.0)  # type: ignore[union-attr]
    books.report(a, Report(before, before, 0, 0), 2.0)
    sends = books.want(a, 1, 14 * MIB, 3.0)
    asked = reclaims(sends)[b]
    books.report(b, Report(asked.limit, 2 * MIB, 0, 0, ack=asked.seq), 3.01)
    assert books.pool(a).lease > before  # type: ignore[union-attr]
    assert books.pool(a).lease + books.pool(b).lease <= 16 * MIB  # type: ignore[union-attr]
    books.check()


def test_minimums_that_do_not_fit_are_reported_and_no_pool_goes_below_its_own() -> None:
    books = restarted(budget=6 * MIB)  # two minimums of 4 MiB
    used = {"a": 0, "b": 0}
    ids, sends = redeclare(books, 16 * MIB, used)
    assert {pool: r.limit for pool, r in reclaims(sends).items()} == {
        ids["a"]: 4 * MIB,
        ids["b"]: 4 * MIB,
    }
    release(books, ids, sends, used)
    gpu = books.view(2.0).gpus[0]
    assert gpu.min_shortfall == 2 * MIB and gpu.overcommitted == 2 * MIB
    assert leases(books.want(ids["a"], 1, 8 * MIB, 3.0)) == {ids["a"]: 4 * MIB}
    books.check()


def test_a_gpu_reported_smaller_than_the_kv_caches_sized_on_it_is_reported() -> None:
    books = restarted(budget=16 * MIB, gpu_bytes=512 * MIB, sized_for=GIB)
    redeclare(books, 8 * MIB, {"a": 0, "b": 0})
    view = books.view(1.0)
    assert view.gpus[0].pools_sized_larger == 2
    assert {p.sized_for for p in view.pools} == {GIB}
    same = restarted(budget=16 * MIB, gpu_bytes=GIB, sized_for=GIB)
    redeclare(same, 8 * MIB, {"a": 0, "b": 0})
    assert same.view(1.0).gpus[0].pools_sized_larger == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_shrink_beyond_the_shares_goes_on_down_to_the_minimums(policy: str) -> None:
    # A's minimum is above an equal share of the new budget: the shares alone (A 12 MiB,
    # B 8 MiB) would leave the GPU over-committed; B, of lower priority, goes on down.
    books = restarted(budget=16 * MIB, policy=policy)
    ids, sends = {}, []
    for i, (pod, priority, kv_min) in enumerate((("a", 500, 12 * MIB), ("b", 100, 2 * MIB))):
        claim = Hello(
            version=1, gpu="GPU-shrink-0", page_size=PAGE, kv_min=kv_min, kv_max=None,
            priority=priority, static=0, namespace="ns", pod=pod, resume=True,
            held=16 * MIB, used=MIB, lease=16 * MIB,
        )  # fmt: skip
        admission = books.admit(claim, 10 + i, 1.0)
        assert admission.record is not None
        ids[pod] = admission.record.id
        sends += admission.sends
    asked = {pod: reclaims(sends)[pool].limit for pod, pool in ids.items()}
    assert asked["a"] >= 12 * MIB and asked["b"] >= 2 * MIB
    assert sum(asked.values()) <= 16 * MIB
