"""The fault suite's sampler stamps each reading with the moment the books were asked for."""

from __future__ import annotations

import time
from typing import Any, cast

from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.demo.serving.books_watch import BooksWatch


class _Agent:
    """Answers with the books as they were when asked (a string stands in for them)."""

    def __init__(self) -> None:
        self.asked_at: list[float] = []

    def try_view(self, timeout_s: float = 2.0) -> Any:
        self.asked_at.append(time.monotonic())
        return f"books asked at {self.asked_at[-1]}"


def test_a_reading_whose_memory_scan_is_slow_carries_the_moment_its_books_were_asked_for() -> None:
    # Reading the servers' memory from /proc can take seconds on loaded cores: a reading
    # stamped after the scan passed books from before a fault's end off as books from
    # after it (the fault suite then saw a charge from before convergence after it).
    agent = _Agent()

    def slow_tree() -> list[int]:
        time.sleep(0.3)
        return []

    watch = BooksWatch(cast(NodeAgentProcess, agent), {"server": slow_tree})
    sample = watch.sample()
    assert sample.view == f"books asked at {agent.asked_at[0]}"
    assert sample.at <= agent.asked_at[0]
    assert time.monotonic() - sample.at >= 0.3
