"""Two real ``vllm serve`` with kvshare on one fake GPU of a real node agent
(``tests/serving/world.py``): start-up turns, bursts that move memory between them, a lease
cut under long requests, and the agent's books against each server's own gauges.

Every moment a test needs is driven, not waited for: requests the test keeps running
(``tests/serving/held.py``) make "while the server serves" true for as long as the test
needs it, and a cut goes to the admin socket while the server's own ``/metrics`` says its
requests run. A bounded wait that runs out is a failure: a reclaim that never comes is one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvshare.demo.real_server import STEPS_METRIC
from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.demo.serving.client import Completion, MetricSample, labels_of, post, scrape, total
from kvshare.demo.serving.vllm_server import VllmServer
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from tests.polling import wait_until
from tests.serving.conftest import BLOCK_BYTES, Ask, serve_all, tokens
from tests.serving.held import KeepRunning
from tests.serving.world import (
    BURST_A,
    BURST_B,
    EQUAL_SHARE,
    GPU_BYTES,
    KV_MIN,
    PAGE_BYTES,
    UNDER_THE_CUT,
    Colocated,
    pool_name,
)

_TURN = re.compile(r"start-up turn on GPU 0 (to|back from) pid (\d+)")


def test_servers_started_together_take_the_gpus_start_up_turn_one_after_the_other(
    colocated: Colocated,
) -> None:
    events = [
        (m.group(1), int(m.group(2)))
        for line in colocated.agent.log_lines()
        if (m := _TURN.search(line))
    ]
    owners = {pid: s.name for s in (colocated.a, colocated.b) for pid in s.tree()}
    order = [(what, owners.get(pid, f"pid {pid}")) for what, pid in events]
    first, second = order[0][1], order[2][1] if len(order) > 2 else "?"
    trees = {s.name: s.tree() for s in (colocated.a, colocated.b)}
    assert {first, second} == {"server-a", "server-b"}, (order, trees)
    assert order == [("to", first), ("back from", first), ("to", second), ("back from", second)]


def _serve_in_background(
    pool: ThreadPoolExecutor, server: VllmServer, asks: Sequence[Ask]
) -> Future[list[Completion]]:
    return pool.submit(serve_all, server, asks, 32)


def test_a_burst_on_a_grows_beyond_its_share_and_a_burst_on_b_reclaims_from_a_while_it_serves(
    colocated: Colocated,
) -> None:
    a, b = colocated.a, colocated.b
    with ThreadPoolExecutor(max_workers=2) as pool:
        # A serves a request the test keeps running until the reclaim has come.
        with KeepRunning(a, 1):
            wait_until(lambda: _running(a) >= 1, 60, "A's held request to run")
            burst_a = _serve_in_background(pool, a, BURST_A)
            # A's burst asks for more than the GPU lends: A grows beyond an equal share,
            # into everything B does not hold, so that B's burst needs a reclaim.
            grown = wait_until(
                lambda: (
                    _unleased(colocated) == 0
                    and (lease := colocated.pool(a).lease) > EQUAL_SHARE
                    and lease
                ),
                60,
                "A's lease to grow beyond an equal share, into all that is free",
            )
            reclaims_before = _reclaims(colocated)
            burst_b = _serve_in_background(pool, b, BURST_B)
            # B is below its share and short: the broker reclaims from A, which serves.
            wait_until(lambda: colocated.pool(a).lease < grown, 60, "a reclaim of A's lease")
            assert _running(a) >= 1
        done_a, done_b = burst_a.result(), burst_b.result()
    assert _reclaims(colocated) > reclaims_before
    assert all(c.status == 200 for c in (*done_a, *done_b))
    assert tokens(done_a) == colocated.expected(BURST_A)
    assert tokens(done_b) == colocated.expected(BURST_B)
    assert colocated.books, "the agent's books were never read"
    over = [(charged, budget) for charged, budget in colocated.books if charged > budget]
    assert not over, f"the broker lent more than the GPU: {over[:5]}"


def test_two_busy_servers_on_two_cores_both_step(colocated: Colocated) -> None:
    # Each server's worker has a core of its own; vLLM's processes wait for each other by
    # spinning. Started in sessions of their own (a scheduling group each, where the kernel
    # groups by session) one server ran at its speed alone while the other took 0-4 % of
    # its steps: the machine must be shared, as the twin and a GPU share their compute.
    a, b = colocated.a, colocated.b
    with KeepRunning(a, 2), KeepRunning(b, 2, seed=901):
        wait_until(lambda: _running(a) >= 2 and _running(b) >= 2, 120, "both servers to decode")
        start = {s.name: _steps(s) for s in (a, b)}

        def made_300() -> dict[str, float] | None:
            made = {s.name: _steps(s) - start[s.name] for s in (a, b)}
            return made if max(made.values()) >= 300 else None

        made = wait_until(made_300, 120, "300 steps on either server", interval=0.5)
    assert min(made.values()) >= 0.25 * max(made.values()), made


def _steps(server: VllmServer) -> float:
    return total(scrape(f"{server.url}/metrics", timeout_s=60.0), STEPS_METRIC)


def _unleased(setup: Colocated) -> int:
    return setup.agent.view().gpus[0].unleased


def _running(server: VllmServer) -> float:
    return total(scrape(f"{server.url}/metrics"), "vllm:num_requests_running")


def _generated_in(metrics: list[MetricSample]) -> float:
    return total(metrics, "vllm:generation_tokens_total")


def _generated(server: VllmServer) -> float:
    return _generated_in(scrape(f"{server.url}/metrics"))


def node_metrics(agent: NodeAgentProcess) -> list[MetricSample]:
    return scrape(f"{agent.url}/metrics")


def _reclaims(setup: Colocated) -> float:
    return total(node_metrics(setup.agent), "kvshare_broker_reclaims_total")


def _ctl_pools(agent: NodeAgentProcess) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "ctl", "--admin-socket", str(agent.admin_socket),
         "--json", "pools"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    pools: list[dict[str, object]] = json.loads(done.stdout)["pools"]
    return pools


FIELDS = ("lease", "mapped", "used", "cached")


def _in_use_agrees(setup: Colocated, server: VllmServer) -> bool:
    """vLLM's share of blocks in use, over what the lease lets it hold, matches the bytes
    the broker counts in use beyond the prefix cache (to two pages)."""
    pool = setup.pool(server)
    usage = total(scrape(f"{server.url}/metrics"), "vllm:kv_cache_usage_perc")
    in_use = usage * pool.lease
    return in_use > 0 and abs(in_use - (pool.used - pool.cached)) <= 2 * PAGE_BYTES


def _idle(setup: Colocated, server: VllmServer) -> bool:
    """vLLM counts no block in use; the broker counts only the null block's page used."""
    pool = setup.pool(server)
    usage = total(scrape(f"{server.url}/metrics"), "vllm:kv_cache_usage_perc")
    return usage == 0.0 and pool.used == PAGE_BYTES and pool.cached == 0


def test_ctl_pools_and_the_agents_metrics_agree_with_each_servers_own_kv_gauges(
    colocated: Colocated,
) -> None:
    for server in (colocated.a, colocated.b):
        # vLLM's block table is the GPU's memory as the agent declared it.
        blocks = labels_of(scrape(f"{server.url}/metrics"), "vllm:cache_config_info")
        assert int(blocks["num_gpu_blocks"]) * BLOCK_BYTES == GPU_BYTES
    a = colocated.a
    # The pool counts whole pages (8 blocks) in use; from the minimum, A's new pages hold
    # only the held requests' blocks, so the two counts differ by the pages they share at
    # most. (After an earlier burst, blocks in use lie scattered over pages of free ones.)
    _shrink_to_the_minimum(colocated, a)
    _ctl(colocated.agent, "set-max", pool_name(colocated, a), "none")
    # Long requests the test keeps running: the pool reports its blocks in use while vLLM
    # counts them (the reports come within a moment of each change).
    with KeepRunning(a, 4):
        wait_until(lambda: _running(a) >= 4, 60, "A to run the four held requests")
        wait_until(lambda: _in_use_agrees(colocated, a), 20, "the pool's and vLLM's KV in use")
    # Idle, prefix caches emptied: both sides agree there is nothing in use, and
    # `kvshare ctl pools` and the agent's metrics show the same books.
    wait_until(lambda: _running(a) == 0, 60, "A's held requests to be aborted")
    for server in (colocated.a, colocated.b):
        post(server.url, "/reset_prefix_cache")
        wait_until(lambda s=server: _idle(colocated, s), 20, f"{server.name} to be idle")
    shown = {str(p["pod"]): p for p in _ctl_pools(colocated.agent)}
    assert set(shown) == {"server-a", "server-b"}
    node = node_metrics(colocated.agent)
    for server in (colocated.a, colocated.b):
        for name in FIELDS:
            value = total(node, f"kvshare_pool_kv_{name}_bytes", pod=server.name)
            assert value == shown[server.name][name] == getattr(colocated.pool(server), name)


def test_a_lease_cut_to_the_minimum_under_long_requests_preempts_and_finishes(
    colocated: Colocated,
) -> None:
    a = colocated.a
    name = pool_name(colocated, a)
    # Four requests that need 29 blocks each (116 in all), cut to the minimum's 32 while
    # at least three of them run with less than half of their tokens out: they cannot all
    # finish without a preemption. Until the cut A may hold all four (128 blocks), so they
    # run together from the start; the cut follows the server's own word that they run.
    # A round in which the machine let them get further first, or end before the server
    # was seen running three of them (its metrics can take seconds to answer while it
    # streams on loaded cores), proves nothing either way and is run again.
    for _round in range(5):
        before = scrape(f"{a.url}/metrics")
        # From the minimum, so that A's pages hold only these requests' blocks when the
        # cut comes (an earlier test's pages would give them room to finish meanwhile).
        _shrink_to_the_minimum(colocated, a)
        _ctl(colocated.agent, "set-max", name, str(ROOM_FOR_FOUR))
        with ThreadPoolExecutor(max_workers=1) as pool:
            running = _serve_in_background(pool, a, UNDER_THE_CUT)
            wait_until(
                lambda batch=running: batch.done() or _running(a) >= 3,
                60,
                "A to run several long requests",
            )
            at_cut = scrape(f"{a.url}/metrics")
            colocated.agent.admin(AdminRequest(op="set-max", pool=name, size=KV_MIN))
            done = running.result()
        _ctl(colocated.agent, "set-max", name, "none")
        assert all(c.status == 200 and len(c.token_ids) == 800 for c in done)
        assert tokens(done) == colocated.expected(UNDER_THE_CUT)
        out_at_cut = _generated_in(at_cut) - _generated_in(before)
        ran_at_cut = total(at_cut, "vllm:num_requests_running")
        if ran_at_cut >= 3 and out_at_cut <= len(UNDER_THE_CUT) * 800 // 2:
            break
    else:
        raise AssertionError("the cut never landed while three requests ran early on")
    preempted = _preemptions(a) - total(before, "vllm:num_preemptions_total")
    assert preempted > 0, f"no preemption after a cut with {out_at_cut:.0f} tokens out"


#: Room for the four requests under the cut to run together to their end (4 x 29 blocks).
ROOM_FOR_FOUR = 16 * 2**20


def _preemptions(server: VllmServer) -> float:
    return total(scrape(f"{server.url}/metrics"), "vllm:num_preemptions_total")


def _shrink_to_the_minimum(setup: Colocated, server: VllmServer) -> None:
    """Cap idle ``server``'s pool at its minimum until it maps no more (its lease is then
    the minimum too); the cap stays for the caller to lift."""
    _ctl(setup.agent, "set-max", pool_name(setup, server), str(KV_MIN))
    wait_until(lambda: setup.pool(server).mapped <= KV_MIN, 30, f"idle {server.name} to shrink")


def _ctl(agent: NodeAgentProcess, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "ctl", "--admin-socket", str(agent.admin_socket),
         *args],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
