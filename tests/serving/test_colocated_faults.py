"""The node agent's faults under real ``vllm serve`` servers and a steady load: killed and
restarted, stopped for a while, down longer than the pools' report interval, restarted on
a GPU reported smaller, a server's pool holding memory past its reclaim deadline, and a
server killed. The servers are the co-located pair of ``tests/serving/world.py``; only the
agent restarts.

Every scenario is driven by :mod:`kvshare.demo.serving.faults` (the load is known to run,
by each server's own ``/metrics``, before the fault) and checked for the same things: no
request fails or comes back short, and every one gives plain vLLM's tokens; while the
agent is away no server holds more than the lease it had; once the books have converged
(within one reclaim deadline of the pools' return) they never charge more than the
budget; the audit flags no pool during ordinary reclaims. After each fault a burst on
server A grows A's lease beyond an equal share of the budget within one reclaim deadline:
the broker still lends the other server's idle memory.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvshare.demo.serving.faults import (
    FaultRun,
    FreezeRun,
    agent_frozen,
    agent_restarted,
    fill,
    wait_for,
)
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from tests.serving.conftest import MIB, serve_all, tokens
from tests.serving.held import KeepRunning
from tests.serving.world import (
    AFTER_BURST,
    GPU_BYTES,
    HEADROOM,
    Colocated,
    pool_name,
    requests,
)

#: The agent's reclaim deadline (its default).
DEADLINE_S = 10.0
#: The pools' report timer (``KVPool``'s default report interval).
REPORT_INTERVAL_S = 5.0
OVER_LEASE = "more than it may hold"


def over_lease_warnings(colocated: Colocated) -> list[str]:
    """The audit's warnings since the scenario began (an earlier test may have held a
    server's requests past a reclaim's deadline on purpose)."""
    lines = [line for line in colocated.agent.log_lines() if OVER_LEASE in line]
    return lines[colocated.alarms_before :]


def check(colocated: Colocated, run: FaultRun) -> None:
    """What every scenario must keep (see the module doc)."""
    assert run.problems == [], run.problems[:5]
    assert run.held_beyond_leases(run.answering_at) == []
    assert run.recovery_s < float("inf"), "the pools never came back into the books"
    assert run.converge_s <= DEADLINE_S, f"converged {run.converge_s:.1f} s after recovery"
    assert run.over_budget_after(run.converged_at) == []
    assert run.over_lease() == []
    assert over_lease_warnings(colocated) == []


def burst_grows_a(colocated: Colocated) -> None:
    """A burst on A grows A's lease beyond an equal share of the budget within one reclaim
    deadline, and every request of it gives plain vLLM's tokens."""
    a = colocated.a
    share = colocated.agent.budget // 2
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        burst = pool.submit(serve_all, a, AFTER_BURST, len(AFTER_BURST))
        grew = wait_for(lambda: colocated.pool(a).lease > share, DEADLINE_S)
        done = burst.result()
    assert grew <= DEADLINE_S, f"A's lease stayed within {share} for {time.monotonic() - started}"
    assert tokens(done) == colocated.expected(AFTER_BURST)


@pytest.fixture
def faults(colocated: Colocated) -> Iterator[Colocated]:
    """The co-located pair with its agent answering; left with the agent's first settings."""
    colocated.alarms_before = 0
    colocated.alarms_before = len(over_lease_warnings(colocated))
    yield colocated
    agent = colocated.agent
    if not agent.running() or (agent.gpu_bytes, agent.headroom) != (GPU_BYTES, HEADROOM):
        agent.stop()
        agent.start(gpu_bytes=GPU_BYTES, headroom=HEADROOM)
        wait_for(lambda: len(colocated.pools()) == 2, 60)


def test_an_agent_killed_under_load_is_back_within_seconds_and_loses_nothing(
    faults: Colocated,
) -> None:
    run = agent_restarted(faults.fault_world(), "killed", kill=True)
    check(faults, run)
    burst_grows_a(faults)


def test_an_agent_stopped_for_a_while_answers_within_a_second_of_running_again(
    faults: Colocated,
) -> None:
    run = agent_frozen(faults.fault_world(), stopped_s=5.0)
    check(faults, run)
    if not _answered_within_a_second(run):
        # Stopped again: the test's own threads share two loaded cores with the servers,
        # and one slow answer can be theirs; the agent's delay after a stop (3-6 s before
        # the fix) showed after every stop.
        run = agent_frozen(faults.fault_world(), stopped_s=5.0)
        check(faults, run)
    assert run.queued_failed == 0
    assert _answered_within_a_second(run), run
    burst_grows_a(faults)


def _answered_within_a_second(run: FreezeRun) -> bool:
    """Within a second of what an answer takes on this machine under the same load (two
    servers decoding on two cores), the admin socket, ``/readyz`` and every request queued
    while the agent was stopped answered: the stop added no more."""
    allowed = 1.0 + run.usual_s
    return max(run.admin_after_s, run.ready_after_s, run.queued_after_s) <= allowed


def test_an_agent_down_longer_than_the_pools_report_interval_loses_nothing(
    faults: Colocated,
) -> None:
    run = agent_restarted(faults.fault_world(), "down", kill=True, down_s=REPORT_INTERVAL_S + 2.0)
    check(faults, run)
    burst_grows_a(faults)


def test_a_restart_on_a_gpu_reported_smaller_reaches_the_new_budget_within_a_deadline(
    faults: Colocated,
) -> None:
    # Both servers first grow into the GPU (a burst each: their leases fill with cache).
    # Then the GPU is reported at half its memory and the budget halves with it, under
    # pools that hold more: the shape of a raised headroom or a smaller configuration.
    world = faults.fault_world()
    assert fill(world, requests(AFTER_BURST)) == []
    held = sum(world.pools(faults.agent.view()).values())
    assert held > 16 * MIB, f"the servers hold {held}: a 16 MiB budget would not shrink"
    run = agent_restarted(world, "smaller", kill=False, gpu_bytes=512 * MIB, headroom=496 * MIB)
    assert run.budget == 16 * MIB
    assert sum(run.leases_at_fault.values()) > run.budget
    check(faults, run)
    gpu = faults.agent.view().gpus[0]
    assert gpu.pools_sized_larger == 2  # vLLM sized both KV caches for the 1 GiB GPU
    assert gpu.min_shortfall == 0
    assert any("less than the" in line for line in faults.agent.log_lines())
    burst_grows_a(faults)


def test_a_pool_that_keeps_memory_past_its_reclaim_deadline_is_flagged(
    faults: Colocated,
) -> None:
    # B runs long requests the test holds, so that it holds memory; then its worker (the
    # process holding its pool's memory) stops, and a cut of its lease cannot be honoured.
    # Within the deadline that is an ordinary reclaim; past it, an alarm.
    agent, b = faults.agent, faults.b
    name = pool_name(faults, b)
    with KeepRunning(b, 2):
        grown = wait_for(lambda: faults.pools()[name].lease >= 8 * MIB, 60.0)
        assert grown < float("inf"), "B's held requests never grew its lease"
        worker = faults.pools()[name].pid
        os.kill(worker, signal.SIGSTOP)
        try:
            cut_at = time.monotonic()
            agent.admin(AdminRequest(op="set-max", pool=name, size=4 * MIB))
            # Within the deadline: an ordinary reclaim, no alarm.
            time.sleep(DEADLINE_S / 2)
            assert not faults.pools()[name].over_lease
            overdue = wait_for(lambda: faults.pools()[name].reclaim_overdue, DEADLINE_S)
            assert overdue < float("inf"), "the deadline passed unnoticed"
            assert time.monotonic() - cut_at >= DEADLINE_S * 0.9
            flagged = wait_for(lambda: faults.pools()[name].over_lease, 5.0)
            assert flagged < float("inf"), "B keeps memory past the deadline and is not flagged"
            assert over_lease_warnings(faults), "no warning in the agent's log"
            assert not faults.pools()[pool_name(faults, faults.a)].over_lease
        finally:
            os.kill(worker, signal.SIGCONT)
    agent.admin(AdminRequest(op="set-max", pool=name, size=None))
    assert wait_for(lambda: not faults.pools()[name].over_lease, 10.0) < float("inf")


def test_a_killed_server_returns_its_lease_within_a_second_and_a_grows_into_it(
    faults: Colocated,
) -> None:
    b = faults.b
    name = pool_name(faults, b)
    assert faults.pool(b).lease > 0
    killed = time.monotonic()
    b.kill()
    assert wait_for(lambda: name not in faults.pools(), 5.0) < float("inf")
    assert time.monotonic() - killed <= 1.0
    assert faults.agent.view().gpus[0].kv_lease == faults.pool(faults.a).lease
    burst_grows_a(faults)
