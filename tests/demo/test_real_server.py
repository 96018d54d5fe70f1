"""The real-server replay's loop: requests go out on time whatever the metrics page does."""

from __future__ import annotations

import threading
import time

import pytest

from kvshare.demo.real_server import replay_and_sample

#: Seconds a test waits for something that should happen at once.
WAIT_S = 10.0


def test_a_sample_stuck_on_a_slow_metrics_page_does_not_hold_back_the_requests_due() -> None:
    late_request_sent = threading.Event()
    sent_at: list[float] = []
    samples: list[float] = []

    def send_due(now_s: float) -> None:
        sent_at.append(now_s)
        if now_s >= 0.3:
            late_request_sent.set()

    def take_sample(now_s: float) -> None:
        if not samples:
            # The first scrape answers only once the replay has gone on without it.
            assert late_request_sent.wait(WAIT_S), "the replay waited for the sample"
        samples.append(now_s)

    replay_and_sample(time.monotonic(), 0.5, 0.1, send_due, take_sample)

    assert late_request_sent.is_set()
    assert samples[0] < 0.1 and samples[-1] == 0.5, samples


def test_a_sample_whose_scrape_times_out_is_skipped_and_the_next_ones_are_taken() -> None:
    samples: list[float] = []

    def take_sample(now_s: float) -> None:
        samples.append(now_s)
        if len(samples) == 1:
            raise TimeoutError("timed out")

    replay_and_sample(time.monotonic(), 0.3, 0.1, lambda _: None, take_sample)

    assert len(samples) >= 3 and samples[-1] == 0.3


def test_a_sample_that_fails_otherwise_fails_the_run_once_the_replay_is_over() -> None:
    sent_at: list[float] = []

    def take_sample(now_s: float) -> None:
        raise ValueError("not a metrics page")

    with pytest.raises(ValueError, match="not a metrics page"):
        replay_and_sample(time.monotonic(), 0.2, 0.1, sent_at.append, take_sample)
    assert sent_at[-1] == 0.2  # the replay ran to its end
