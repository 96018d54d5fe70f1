"""The audit's rule: a pool is over its lease when the device shows more than the broker
charges it (its lease, plus what a reclaim within its deadline asked back), or more than
its lease once that deadline has passed; never during an ordinary reclaim. The books are
the real ones; the device reading is given (what a pool's process holds)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvshare.api.wire import Report
from kvshare.deviceplugin.broker.audit import audit
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.broker.policy import FairShare
from kvshare.deviceplugin.broker.views import BooksView

from .test_books import GIB, GPU, PAGE, admit, reclaims

# Two pools of 2 GiB static on the 16 GiB test GPU, 1 GiB headroom: 11 GiB of budget.


def over(books: Books, now: float, device: dict[int, int]) -> dict[str, bool]:
    """Pool name -> flagged, with the device showing ``device[pid]`` for each process."""
    view, findings = audit(lambda: books.view(now), "host", lambda gpu: None, device.get)
    names = {p.id: p.name for p in view.pools}
    return {names[f.pool_id]: f.over_lease for f in findings}


def reclaiming(deadline_s: float = 5.0) -> tuple[Books, int, Report]:
    """A holding 8 GiB in use, reclaimed down to an equal share for B (under fair-share,
    whose asks do not lapse: the reclaim stands as long as B waits)."""
    books = Books([GPU], headroom=GIB, reclaim_deadline_s=deadline_s, policy=FairShare())
    a = admit(books, "a", 10, kv_min=0)
    books.want(a, 1, 8 * GIB, 0.0)
    books.report(a, Report(mapped=8 * GIB, used=8 * GIB, cached=0, reserved=0), 0.0)
    b = admit(books, "b", 11, kv_min=0)
    asked = reclaims(books.want(b, 1, 8 * GIB, 1.0))[a]
    assert asked.limit < 8 * GIB - PAGE  # the lease is lowered at once ...
    return books, a, Report(mapped=8 * GIB, used=8 * GIB, cached=0, reserved=0, ack=asked.seq)


def test_a_pool_releasing_a_reclaim_within_its_deadline_is_not_over_its_lease() -> None:
    books, _, _ = reclaiming()
    # ... and the memory follows as the requests on it finish: not over-use.
    assert over(books, 2.0, {10: 8 * GIB, 11: GIB}) == {"ns/a": False, "ns/b": False}


def test_a_pool_holding_more_than_it_is_charged_is_over_its_lease() -> None:
    books, _, _ = reclaiming()
    assert over(books, 2.0, {10: 8 * GIB + 2 * PAGE, 11: GIB})["ns/a"]
    # A page of slack: the pool's own rounding.
    assert not over(books, 2.0, {10: 8 * GIB + PAGE, 11: GIB})["ns/a"]


def test_a_pool_keeping_reclaimed_memory_past_the_deadline_is_over_its_lease() -> None:
    books, a, still = reclaiming(deadline_s=5.0)
    books.report(a, still, 4.0)  # still holding everything, with the reclaim in force
    assert not over(books, 4.0, {10: 8 * GIB, 11: GIB})["ns/a"]
    books.tick(6.5)  # the deadline passed
    assert over(books, 6.5, {10: 8 * GIB, 11: GIB})["ns/a"]
    lease = books.pool(a).lease  # type: ignore[union-attr]
    assert not over(books, 6.5, {10: lease, 11: GIB})["ns/a"]


def test_a_grant_between_reading_the_books_and_the_device_is_not_over_use() -> None:
    books = Books([GPU], headroom=GIB)
    a = admit(books, "a", 10, kv_min=0)
    books.want(a, 1, 2 * GIB, 0.0)
    views: Iterator[BooksView] = iter([books.view(0.0)])

    def grow_then_read(pid: int) -> int:
        books.want(a, 2, 6 * GIB, 0.1)  # granted while the device is read ...
        return 6 * GIB  # ... and already mapped

    def view() -> BooksView:
        return next(views, None) or books.view(0.1)

    _, findings = audit(view, "host", lambda gpu: None, grow_then_read)
    assert [f.over_lease for f in findings] == [False]


def test_two_pools_of_one_process_are_judged_together() -> None:
    books = Books([GPU], headroom=GIB)
    first = admit(books, "a", 10, kv_min=0)
    second = admit(books, "b", 10, kv_min=0)
    books.want(first, 1, 2 * GIB, 0.0)
    books.want(second, 1, 2 * GIB, 0.0)
    device: Callable[[int], int] = {10: 4 * GIB}.__getitem__
    _, findings = audit(lambda: books.view(0.0), "host", lambda gpu: None, device)
    assert [f.over_lease for f in findings] == [False, False]
    _, findings = audit(lambda: books.view(0.0), "host", lambda gpu: None, lambda pid: 5 * GIB)
    assert [f.over_lease for f in findings] == [True, True]
