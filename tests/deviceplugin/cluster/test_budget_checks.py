"""The node agent says when a GPU's budget cannot hold what runs on it: guaranteed minimums
beyond the budget, or a GPU smaller than the KV caches sized on it. The real books after a
restart with a smaller budget; the Events are recorded as the agent would post them."""

from __future__ import annotations

from kvshare.api.wire import Hello
from kvshare.deviceplugin.broker.books import Books, ExpectedPool
from kvshare.deviceplugin.cluster.budget_checks import (
    MINIMUMS_CONDITION,
    SIZE_CONDITION,
    BudgetChecks,
)
from kvshare.deviceplugin.inventory import GpuInfo

MIB = 2**20
GIB = 2**30


def restarted(gpu_bytes: int, budget: int) -> Books:
    """An agent restarted with ``budget`` to lend on a GPU of ``gpu_bytes``, whose two
    pools (4 MiB minimums, KV caches sized for 1 GiB) re-declare 8 MiB each."""
    gpu = GpuInfo(uuid="GPU-budget-0", index=0, name="test", total_bytes=gpu_bytes)
    expected = [
        ExpectedPool(pid=10 + i, name=f"ns/{pod}", gpu=gpu.uuid, static=0, kv_min=4 * MIB,
                     gpu_total=GIB)
        for i, pod in enumerate("ab")
    ]  # fmt: skip
    books = Books([gpu], headroom=gpu_bytes - budget, expected=expected, recovery_deadline=30.0)
    for i, pod in enumerate("ab"):
        hello = Hello(
            version=1, gpu=gpu.uuid, page_size=MIB, kv_min=4 * MIB, kv_max=None, priority=100,
            static=0, namespace="ns", pod=pod, resume=True, held=8 * MIB, lease=8 * MIB,
        )  # fmt: skip
        assert books.admit(hello, 10 + i, 1.0).record is not None
    return books


def test_minimums_beyond_the_budget_turn_the_condition_false_and_post_one_event() -> None:
    books = restarted(GIB, budget=6 * MIB)
    posted: list[tuple[str, str]] = []
    checks = BudgetChecks(lambda: books.view(2.0), post=lambda r, m: posted.append((r, m)))
    checks.check()
    checks.check()  # unchanged: no second Event
    conditions = {c.type: c for c in checks.conditions()}
    minimums = conditions[MINIMUMS_CONDITION]
    assert (minimums.status, minimums.reason) == ("False", "MinimumsExceedBudget")
    assert "need 2.0Mi more than its budget" in minimums.message
    assert conditions[SIZE_CONDITION].status == "True"
    assert [reason for reason, _ in posted] == ["MinimumsExceedBudget"]


def test_a_gpu_smaller_than_the_kv_caches_sized_on_it_is_said() -> None:
    books = restarted(512 * MIB, budget=16 * MIB)
    posted: list[tuple[str, str]] = []
    checks = BudgetChecks(lambda: books.view(2.0), post=lambda r, m: posted.append((r, m)))
    checks.check()
    conditions = {c.type: c for c in checks.conditions()}
    size = conditions[SIZE_CONDITION]
    assert (size.status, size.reason) == ("False", "GpuSmallerThanKVCaches")
    assert "GPU 0 reports 512.0Mi" in size.message and "2 pool(s)" in size.message
    assert conditions[MINIMUMS_CONDITION].status == "True"
    assert [reason for reason, _ in posted] == ["GpuSmallerThanKVCaches"]


def test_a_budget_that_holds_everything_says_so() -> None:
    books = restarted(GIB, budget=32 * MIB)
    checks = BudgetChecks(lambda: books.view(2.0))
    checks.check()
    assert {c.type: c.status for c in checks.conditions()} == {
        MINIMUMS_CONDITION: "True",
        SIZE_CONDITION: "True",
    }
