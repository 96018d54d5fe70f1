"""One reconcile per ModelServer at a time: requests coalesce, failures retry, then give up."""

from __future__ import annotations

import asyncio

import pytest

from kvshare.operator.keyed import KeyedRunner


@pytest.mark.asyncio
async def test_requests_during_a_run_fold_into_exactly_one_more_run() -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    runs: list[str] = []
    running: set[str] = set()

    async def work(key: str) -> None:
        assert key not in running, "two runs of one key at once"
        running.add(key)
        runs.append(key)
        started.set()
        await release.wait()
        running.discard(key)

    async def give_up(key: str, error: Exception) -> None:
        raise AssertionError(f"gave up on {key}: {error}")

    runner: KeyedRunner[str] = KeyedRunner(work, give_up, retry_delays=())
    first = asyncio.create_task(runner.request("a"))
    await started.wait()
    assert runner.busy("a")
    for _ in range(5):
        await runner.request("a")  # returns at once: folded into the run in progress
    other = asyncio.create_task(runner.request("b"))  # another key runs alongside
    await asyncio.sleep(0.01)
    assert runs == ["a", "b"]
    release.set()
    await asyncio.gather(first, other)
    assert runs == ["a", "b", "a"]
    assert not runner.busy("a")


@pytest.mark.asyncio
async def test_failures_are_retried_then_reported_and_the_next_request_starts_over() -> None:
    attempts: list[int] = []
    reported: list[str] = []

    async def work(key: str) -> None:
        attempts.append(len(attempts))
        raise RuntimeError("API server unavailable")

    async def give_up(key: str, error: Exception) -> None:
        reported.append(f"{key}: {error}")

    runner: KeyedRunner[str] = KeyedRunner(work, give_up, retry_delays=(0.0, 0.0))
    await runner.request("a")
    assert len(attempts) == 3
    assert reported == ["a: API server unavailable"]
    await runner.request("a")
    assert len(attempts) == 6
