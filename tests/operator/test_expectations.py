"""The operator's own creates and deletes count until the watch shows them."""

from __future__ import annotations

from kvshare.operator.expectations import EXPECTATION_TTL, Expectations
from tests.operator.specs import pod


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_created_pod_counts_until_the_index_has_it() -> None:
    expectations = Expectations(Clock())
    created = pod(1, ready=False)
    expectations.created(created)
    assert expectations.overlay([pod(0)], ("llm", "qwen")) == [pod(0), created]
    assert expectations.overlay([], ("llm", "other")) == []
    indexed = pod(1, ready=True)
    assert expectations.overlay([pod(0), indexed], ("llm", "qwen")) == [pod(0), indexed]
    assert expectations.overlay([pod(0)], ("llm", "qwen")) == [pod(0)]  # confirmed, dropped


def test_a_deleted_pod_is_terminating_until_the_index_drops_it() -> None:
    expectations = Expectations(Clock())
    expectations.deleted(pod(2))
    (shown,) = expectations.overlay([pod(2)], ("llm", "qwen"))
    assert shown.terminating
    # Another ModelServer's overlay does not confirm (or drop) this expectation.
    assert expectations.overlay([], ("llm", "other")) == []
    assert expectations.overlay([pod(2)], ("llm", "qwen"))[0].terminating
    assert expectations.overlay([], ("llm", "qwen")) == []
    assert not expectations.overlay([pod(2)], ("llm", "qwen"))[0].terminating


def test_unconfirmed_expectations_expire_and_forget_drops_a_modelservers() -> None:
    clock = Clock()
    expectations = Expectations(clock)
    expectations.created(pod(0, ms="a"))
    expectations.created(pod(0, ms="b"))
    clock.now = EXPECTATION_TTL + 1
    assert expectations.overlay([], ("llm", "a")) == []
    expectations.forget(("llm", "b"))
    assert expectations.overlay([]) == []
