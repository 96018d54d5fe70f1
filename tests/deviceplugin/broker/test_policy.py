"""The entitlement policy through the books: what it lends, what it takes back from whom,
and the asks it stops believing."""

from __future__ import annotations

import pytest

from kvshare.api.wire import Report
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.broker.policy import POLICIES, Entitlement, policy_named

from .test_books import GIB, GPU, admit, leases, reclaims

# Two pools with 2 GiB of static each on the 16 GiB test GPU, 1 GiB headroom: 11 GiB of
# budget, an entitlement of 5.5 GiB each.


def books_with(**options: object) -> Books:
    return Books([GPU], headroom=GIB, policy=Entitlement(**options))  # type: ignore[arg-type]


def busy(books: Books, pool: int, nbytes: int, now: float) -> None:
    """The pool asks for ``nbytes`` and reports its blocks in all it got."""
    books.want(pool, 1, nbytes, now)
    lease = books.pool(pool).lease  # type: ignore[union-attr]
    books.report(pool, Report(mapped=lease, used=lease, cached=0, reserved=0), now)


def test_a_pool_below_its_entitlement_gets_memory_in_use_back_from_a_borrower() -> None:
    books = books_with(headroom_share=0.0)
    borrower = admit(books, "borrower", 10, kv_min=0)
    busy(books, borrower, 11 * GIB, 0.0)
    newcomer = admit(books, "newcomer", 11, kv_min=0)
    asked = reclaims(books.want(newcomer, 1, 8 * GIB, 1.0))
    # Its blocks are in use, but it holds more than its entitlement: down to it, no lower.
    assert asked[borrower].limit == 11 * GIB // 2


def test_borrowers_take_only_idle_memory_from_each_other() -> None:
    books = Books([GPU], headroom=GIB, policy=Entitlement(headroom_share=0.0))
    # Three pools with 2 GiB static: 9 GiB of budget, 3 GiB of entitlement each.
    a = admit(books, "a", 10, kv_min=0)
    busy(books, a, 4 * GIB, 0.0)
    b = admit(books, "b", 11, kv_min=0)
    busy(books, b, 4 * GIB, 0.0)
    c = admit(books, "c", 12, kv_min=0)
    busy(books, c, GIB, 0.0)
    # b holds more than its entitlement and wants more; a's blocks above its own are in
    # use: a keeps them (they come back as its requests finish and it stops being short).
    assert reclaims(books.want(b, 2, 6 * GIB, 1.0)) == {}
    # c is below its entitlement: for it, both borrowers give back what they hold above.
    asked = reclaims(books.want(c, 2, 3 * GIB, 1.1))
    assert {pool: r.limit for pool, r in asked.items()} == {a: 3 * GIB, b: 3 * GIB}


def test_memory_in_use_comes_first_from_a_borrower_with_nothing_waiting() -> None:
    """A lowered lease holds a pool's queue until it has shrunk: a borrower that is short
    itself would make its own requests wait, one with nothing waiting makes no one wait."""
    books = Books([GPU], headroom=GIB, policy=Entitlement(headroom_share=0.0))
    # Three pools with 2 GiB static: 9 GiB of budget, 3 GiB of entitlement each.
    quiet = admit(books, "quiet", 10, kv_min=0)
    busy(books, quiet, 7 * GIB // 2, 0.0)
    queued = admit(books, "queued", 11, kv_min=0)
    busy(books, queued, 9 * GIB // 2, 0.0)
    small = admit(books, "small", 12, kv_min=0)
    busy(books, small, GIB, 0.0)
    assert reclaims(books.want(queued, 2, 6 * GIB, 1.0)) == {}  # above its entitlement
    asked = reclaims(books.want(small, 2, 2 * GIB, 1.1))
    # "queued" holds the most above its entitlement, but it waits too: "quiet" gives
    # all it holds above its entitlement first, "queued" only the rest.
    assert {pool: r.limit for pool, r in asked.items()} == {quiet: 3 * GIB, queued: 4 * GIB}


def test_an_ask_not_heard_again_no_longer_holds_memory() -> None:
    books = books_with(headroom_share=0.0, fresh_s=1.5)
    stale = admit(books, "stale", 10, kv_min=0)
    busy(books, stale, 6 * GIB, 0.0)
    other = admit(books, "other", 11, kv_min=0)
    busy(books, other, 5 * GIB, 0.0)
    books.want(stale, 2, 9 * GIB, 0.5)  # it asks for more, in vain; then its burst ends
    books.report(stale, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 1.0)
    # Two seconds on it has not asked again: what it leases beyond what it uses is idle.
    asked = reclaims(books.want(other, 2, 10 * GIB, 2.5))
    assert asked[stale].limit == GIB


def test_a_lease_just_granted_is_not_taken_back_before_the_pool_reports_using_it() -> None:
    books = books_with(headroom_share=0.0, fresh_s=1.5)
    fresh = admit(books, "fresh", 10, kv_min=0)
    entitled = 11 * GIB // 2
    assert leases(books.want(fresh, 1, entitled, 0.0)) == {fresh: entitled}
    other = admit(books, "other", 11, kv_min=0)
    busy(books, other, entitled, 0.1)
    # "fresh" reported nothing yet: its new lease looks idle, but it asked a moment ago.
    assert reclaims(books.want(other, 2, 8 * GIB, 0.2)) == {}
    # Once its ask is old and its report says it uses nothing, the lease is idle.
    books.report(fresh, Report(mapped=0, used=0, cached=0, reserved=0), 1.0)
    assert fresh in reclaims(books.want(other, 3, 9 * GIB, 2.0))


def test_a_quiet_pool_below_its_entitlement_keeps_headroom_above_what_it_uses() -> None:
    books = books_with(headroom_share=0.25)
    quiet = admit(books, "quiet", 10, kv_min=0)
    books.want(quiet, 1, 4 * GIB, 0.0)
    books.report(quiet, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 0.0)
    hungry = admit(books, "hungry", 11, kv_min=0)
    asked = reclaims(books.want(hungry, 1, 11 * GIB, 5.0))
    # It uses 1 GiB; a quarter of its 5.5 GiB entitlement stays with it for its next burst.
    headroom = -(-(11 * GIB // 2 // 4) // (2 * 2**20)) * (2 * 2**20)
    assert asked[quiet].limit == pytest.approx(GIB + headroom, abs=2 * 2**20)


def test_by_default_a_quiet_pool_gives_back_all_it_does_not_use() -> None:
    # Headroom kept with every quiet pool cost more capacity at the SLO than it saved (see
    # the policy's module doc): a short pool gets everything a quiet one does not use.
    books = Books([GPU], headroom=GIB)
    quiet = admit(books, "quiet", 10, kv_min=0)
    books.want(quiet, 1, 4 * GIB, 0.0)
    books.report(quiet, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 0.0)
    hungry = admit(books, "hungry", 11, kv_min=0)
    asked = reclaims(books.want(hungry, 1, 11 * GIB, 5.0))
    assert asked[quiet].limit == GIB


def test_a_quiet_pools_prefix_cache_is_lent_on_to_a_busy_pool_above_its_entitlement() -> None:
    # A quiet vLLM server's freed blocks stay as prefix cache until it needs room, so its
    # whole lease reports as used; the pool evicts them as soon as its lease is lowered.
    books = books_with(headroom_share=0.0)
    quiet = admit(books, "quiet", 10, kv_min=0)
    books.want(quiet, 1, 4 * GIB, 0.0)
    books.report(quiet, Report(mapped=4 * GIB, used=4 * GIB, cached=7 * GIB // 2, reserved=0), 0.0)
    hungry = admit(books, "hungry", 11, kv_min=0)
    busy(books, hungry, 7 * GIB, 0.1)  # above its 5.5 GiB entitlement: only idle memory is lent
    asked = reclaims(books.want(hungry, 2, 11 * GIB, 5.0))
    assert asked[quiet].limit == GIB // 2  # what its running requests hold


def test_every_policy_is_known_by_its_name() -> None:
    assert set(POLICIES) == {"fair-share", "entitlement"}
    assert policy_named("entitlement").name == "entitlement"
    with pytest.raises(ValueError, match="known: entitlement, fair-share"):
        policy_named("greedy")
