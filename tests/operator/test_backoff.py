"""Replicas whose pods keep failing are replaced after a delay that doubles with each
failure in a row up to a cap, starts over once the replica has been ready for a while,
and is skipped when the spec changed; the failing replicas are reported by pod and reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvshare.operator.backoff import BackoffPolicy, FailureBackoff, ReplicaFailure
from kvshare.operator.views import PodView
from tests.operator.specs import pod

KEY = ("llm", "qwen")
HASH = "h1"
POLICY = BackoffPolicy(initial=10, maximum=300, reset_after=600)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failed(replica: int, attempt: int, reason: str = "Evicted: low on memory") -> PodView:
    """Attempt ``attempt`` of replica ``replica``'s pod, Failed (each attempt a new uid)."""
    return replace(
        pod(replica, template=HASH, ready=False, phase="Failed"),
        uid=f"uid-{replica}-{attempt}",
        failure=reason,
    )


def running(replica: int, attempt: int, ready: bool) -> PodView:
    return replace(pod(replica, template=HASH, ready=ready), uid=f"uid-{replica}-{attempt}")


def failed_twice(clock: Clock) -> FailureBackoff:
    """A backoff that saw replica 0 fail twice in a row (the next wait is 40s)."""
    backoff = FailureBackoff(POLICY, clock)
    backoff.observe(KEY, [failed(0, 1)], HASH, 1)
    clock.now += 20
    backoff.observe(KEY, [failed(0, 2)], HASH, 1)
    return backoff


def test_the_delay_doubles_from_the_initial_one_up_to_the_cap() -> None:
    assert [POLICY.delay(n) for n in range(1, 9)] == [10, 20, 40, 80, 160, 300, 300, 300]


def test_a_failed_pod_is_held_until_its_delay_passed_and_counted_once() -> None:
    clock = Clock()
    backoff = FailureBackoff(POLICY, clock)
    first = backoff.observe(KEY, [failed(0, 1), running(1, 1, True)], HASH, 2)
    assert first.held == {0}
    assert first.wake_in == 10
    assert first.failing == (ReplicaFailure(0, "qwen-0", "Evicted: low on memory", 1, 10),)
    clock.now += 9  # the same failed pod seen again: still one failure, still held
    again = backoff.observe(KEY, [failed(0, 1), running(1, 1, True)], HASH, 2)
    assert again.held == {0} and again.wake_in == pytest.approx(1)
    assert again.failing == first.failing
    clock.now += 1
    due = backoff.observe(KEY, [failed(0, 1), running(1, 1, True)], HASH, 2)
    assert due.held == frozenset() and due.wake_in is None
    assert due.failing == first.failing  # failing until a pod of the replica is ready


def test_failures_in_a_row_wait_longer_each_time() -> None:
    clock = Clock()
    backoff = FailureBackoff(POLICY, clock)
    waits = []
    for attempt in range(1, 8):
        backoff.observe(KEY, [running(0, attempt, False)], HASH, 1)  # retried, not ready
        result = backoff.observe(KEY, [failed(0, attempt)], HASH, 1)
        assert result.held == {0}
        waits.append(result.wake_in)
        clock.now += 1000  # long past the delay: the next pod is made
    assert waits == [10, 20, 40, 80, 160, 300, 300]
    (failure,) = result.failing
    assert failure.describe() == (
        "pod qwen-0 failed 7 times in a row (Evicted: low on memory); replica 0 is replaced "
        "5m after its last failure"
    )


def test_a_replica_ready_for_the_reset_time_starts_over() -> None:
    clock = Clock()
    backoff = failed_twice(clock)
    clock.now += 40
    ready = backoff.observe(KEY, [running(0, 3, True)], HASH, 1)
    assert ready.failing == () and ready.held == frozenset()  # Degraded clears when ready
    clock.now += 599  # ready, but not for long enough: the next failure is the third
    assert backoff.observe(KEY, [failed(0, 3)], HASH, 1).wake_in == 40
    clock.now += 100
    backoff.observe(KEY, [running(0, 4, True)], HASH, 1)
    clock.now += 600  # ready for the reset time
    backoff.observe(KEY, [running(0, 4, True)], HASH, 1)
    clock.now += 3600
    assert backoff.observe(KEY, [failed(0, 4)], HASH, 1).wake_in == 10


def test_the_reset_counts_even_when_no_reconcile_saw_the_time_pass() -> None:
    clock = Clock()
    backoff = failed_twice(clock)
    clock.now += 40
    backoff.observe(KEY, [running(0, 3, True)], HASH, 1)
    clock.now += 7200  # ready for two hours, then it fails
    assert backoff.observe(KEY, [failed(0, 3)], HASH, 1).wake_in == 10


def test_a_failed_pod_of_an_older_spec_is_replaced_at_once_and_the_count_starts_over() -> None:
    clock = Clock()
    backoff = failed_twice(clock)
    # The user fixes the spec: the failed pod of the old one is not held.
    fixed = backoff.observe(KEY, [failed(0, 2)], "h2", 1)
    assert fixed.held == frozenset()
    clock.now += 5
    new_spec = replace(failed(0, 3), template_hash="h2")
    assert backoff.observe(KEY, [new_spec], "h2", 1).wake_in == 10


def test_crash_looping_containers_are_reported_but_left_to_the_kubelet() -> None:
    backoff = FailureBackoff(POLICY, Clock())
    looping = replace(running(0, 1, False), crash_looping="container engine: Error, exit code 1")
    result = backoff.observe(KEY, [looping, running(1, 1, True)], HASH, 2)
    assert result.held == frozenset() and result.wake_in is None
    (failure,) = result.failing
    assert failure.describe() == (
        "pod qwen-0 keeps exiting (container engine: Error, exit code 1); the kubelet "
        "restarts it with a growing delay"
    )


def test_replicas_scaled_away_and_deleted_modelservers_are_forgotten() -> None:
    clock = Clock()
    backoff = FailureBackoff(POLICY, clock)
    backoff.observe(KEY, [failed(0, 1), failed(1, 1)], HASH, 2)
    other = ("llm", "other")
    backoff.observe(other, [replace(failed(0, 1), modelserver="other")], HASH, 1)
    # Scaled to one: replica 1's failure is gone, replica 0's stays.
    result = backoff.observe(KEY, [failed(0, 1)], HASH, 1)
    assert [f.replica for f in result.failing] == [0]
    backoff.forget(KEY)
    clock.now += 1
    assert backoff.observe(KEY, [failed(0, 2)], HASH, 1).wake_in == 10  # first failure again
    assert backoff.observe(other, [], HASH, 1).failing != ()  # another ModelServer's stays


def test_a_replica_waiting_for_its_next_pod_stays_failing() -> None:
    clock = Clock()
    backoff = FailureBackoff(POLICY, clock)
    backoff.observe(KEY, [failed(0, 1)], HASH, 1)
    clock.now += 10
    deleted = backoff.observe(KEY, [replace(failed(0, 1), terminating=True)], HASH, 1)
    assert deleted.held == frozenset()
    assert [f.failures for f in deleted.failing] == [1]
    assert [f.failures for f in backoff.observe(KEY, [], HASH, 1).failing] == [1]
