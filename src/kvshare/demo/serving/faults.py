"""Faults of the node agent under real servers: what happens, measured, not judged.

Each scenario runs while a :class:`~kvshare.demo.serving.steady_load.SteadyLoad` keeps
requests in flight on every server of a :class:`FaultWorld` (one fake GPU, its node agent,
``vllm serve`` servers leased by it) and a :class:`~kvshare.demo.serving.books_watch.BooksWatch`
samples the books and the servers' memory. The fault itself is driven: the load is
known to be running (each server's own ``/metrics`` says so) before the agent is killed,
stopped or restarted. What follows is recorded in a :class:`FaultRun`; its methods list
what went wrong (``tests/serving/test_colocated_faults.py`` asserts there is nothing,
``bench/agent_faults.py`` reports the times).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvshare.demo.serving.agent_process import NodeAgentProcess
from kvshare.demo.serving.books_watch import BooksWatch, Sample
from kvshare.demo.serving.client import scrape, total
from kvshare.demo.serving.steady_load import Answer, Request, SteadyLoad
from kvshare.demo.serving.vllm_server import VllmServer
from kvshare.deviceplugin.admin.client import AdminClient, AdminError
from kvshare.deviceplugin.broker.connections.admin_requests import AdminRequest
from kvshare.deviceplugin.broker.views import BooksView

__all__ = [
    "FaultRun",
    "FaultWorld",
    "FreezeRun",
    "agent_frozen",
    "agent_restarted",
    "fill",
    "running_requests",
    "wait_for",
]


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until ``predicate`` held, or ``inf`` if it did not within ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            return float("inf")
        time.sleep(interval_s)
    return time.monotonic() - start


def running_requests(server: VllmServer) -> float:
    """Requests the server runs now, as its own ``/metrics`` says."""
    return total(scrape(f"{server.url}/metrics"), "vllm:num_requests_running")


def _runs(server: VllmServer) -> bool:
    return running_requests(server) >= 1


@dataclass(frozen=True)
class FaultWorld:
    """One fake GPU, its agent and the servers it leases to, and a steady load for them."""

    agent: NodeAgentProcess
    servers: Mapping[str, VllmServer]
    """Server name (its pod name in the books) -> server."""
    requests: Sequence[Request]
    reference: Mapping[tuple[int, ...], tuple[int, ...]]
    """Plain vLLM's tokens for every request's prompt."""
    page_bytes: int
    """One page id of the pools (their audit and re-declarations round to it)."""
    clients: int = 2
    """Requests in flight per server."""

    def pools(self, view: BooksView) -> dict[str, int]:
        """Server name -> the lease of its pool in ``view``."""
        return {p.pod: p.lease for p in view.pools if p.pod in self.servers}


@dataclass
class FaultRun:
    """What one scenario recorded (monotonic seconds; ``inf``: it did not happen)."""

    name: str
    budget: int
    fault_at: float
    leases_at_fault: dict[str, int]
    answering_at: float = float("inf")
    """When the agent answered its admin socket again."""
    recovered_at: float = float("inf")
    """When every server's pool was back in the books and the books no longer recovering."""
    converged_at: float = float("inf")
    """When the charges were within the budget again, after recovery."""
    answers: list[Answer] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    ungranted: float = 0.0
    """Reclaims that granted nothing, counted by the agent since its (re)start."""
    page: int = 0
    """The pools' page: the slack their memory may have over a lease."""

    @property
    def recovery_s(self) -> float:
        """From the fault to every pool back in the books."""
        return self.recovered_at - self.fault_at

    @property
    def redeclare_s(self) -> float:
        """From the agent answering again to every pool back in the books."""
        return self.recovered_at - self.answering_at

    @property
    def converge_s(self) -> float:
        """From recovery to the charges within the budget."""
        return max(0.0, self.converged_at - self.recovered_at)

    @property
    def longest_request_s(self) -> float:
        """The longest request in flight at some moment from the fault to recovery."""
        during = [a for a in self.answers if a.sent_at <= self.recovered_at]
        during = [a for a in during if a.answered_at >= self.fault_at]
        return max((a.seconds for a in during), default=0.0)

    def held_beyond_leases(self, until: float) -> list[str]:
        """Samples before ``until`` in which a server held more KV memory than the lease
        its pool had when the fault began (plus a page)."""
        found = []
        for sample in self.samples:
            if self.fault_at <= sample.at <= until:
                for name, held in sample.held.items():
                    lease = self.leases_at_fault.get(name)
                    if lease is not None and held > lease + self.page:
                        found.append(f"{name} held {held} > lease {lease} at {sample.at:.2f}")
        return found

    def over_budget_after(self, start: float) -> list[str]:
        """Samples from ``start`` on in which the books charged more than the budget."""
        return [
            f"charged {g.kv_charged} > budget {self.budget} at {s.at:.2f}"
            for s in self.samples
            if s.at >= start and s.view is not None
            for g in s.view.gpus
            if g.kv_charged > self.budget
        ]

    def over_lease(self) -> list[str]:
        """Samples in which the audit flagged a pool."""
        return [
            f"{p.name} flagged over its lease at {s.at:.2f} (device {p.device_bytes}, "
            f"lease {p.lease}, charged {p.charged})"
            for s in self.samples
            if s.view is not None
            for p in s.view.pools
            if p.over_lease
        ]


@contextlib.contextmanager
def under_load(world: FaultWorld, name: str) -> Iterator[tuple[SteadyLoad, BooksWatch, FaultRun]]:
    """A steady load known to be running on every server, the books watched; the run."""
    watch = BooksWatch(world.agent, {n: s.tree for n, s in world.servers.items()}).start()
    load = SteadyLoad(
        {n: s.url for n, s in world.servers.items()},
        world.requests,
        world.reference,
        clients=world.clients,
    ).start()
    run = FaultRun(name, world.agent.budget, 0.0, {}, page=world.page_bytes)
    try:
        for server in world.servers.values():
            if wait_for(functools.partial(_runs, server), 120.0) == float("inf"):
                run.problems.append(f"{server.name} never ran a request of the load")
        yield load, watch, run
    finally:
        run.answers = load.stop()
        run.samples = watch.stop()
        run.problems += load.problems(run.answers)


def fill(world: FaultWorld, requests: Sequence[Request]) -> list[str]:
    """Every server serves ``requests`` at once, so that each grows into what they need
    (and keeps it as prefix cache afterwards); the problems of the answers (their tokens
    against ``world.reference``, which must hold them)."""
    load = SteadyLoad(
        {n: s.url for n, s in world.servers.items()}, requests, world.reference, clients=0
    )
    with ThreadPoolExecutor(max_workers=len(requests) * len(world.servers)) as pool:
        answers = list(
            pool.map(
                lambda job: load.one(*job),
                [(n, s.url, r) for n, s in world.servers.items() for r in requests],
            )
        )
    return load.problems(answers)


def _fault_begins(world: FaultWorld, run: FaultRun) -> None:
    run.leases_at_fault = world.pools(world.agent.view())
    run.fault_at = time.monotonic()


def _recovered(world: FaultWorld) -> bool:
    view = world.agent.try_view()
    return (
        view is not None
        and not view.recovering
        and set(world.servers) <= set(world.pools(view))
        and world.agent.ready()
    )


def _within_budget(world: FaultWorld) -> bool:
    view = world.agent.try_view()
    return view is not None and all(g.kv_charged <= world.agent.budget for g in view.gpus)


def _ungranted(world: FaultWorld) -> float:
    with contextlib.suppress(OSError):
        text = world.agent.metrics()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvshare_broker_reclaims_ungranted_total{")
        )
    return 0.0


def agent_restarted(
    world: FaultWorld,
    name: str,
    *,
    kill: bool = True,
    down_s: float = 0.0,
    headroom: int | None = None,
    gpu_bytes: int | None = None,
    deadline_s: float = 10.0,
    after_s: float = 2.0,
) -> FaultRun:
    """Kill (SIGKILL) or stop (SIGTERM) the agent under load, keep it down ``down_s``, start
    it again (with another headroom or GPU size if given), and follow the load for
    ``after_s`` more once the charges are within the budget."""
    with under_load(world, name) as (_, _, run):
        _fault_begins(world, run)
        if kill:
            world.agent.kill()
        else:
            world.agent.stop()
        time.sleep(down_s)
        world.agent.start(headroom=headroom, gpu_bytes=gpu_bytes)
        run.budget = world.agent.budget
        run.answering_at = time.monotonic()
        run.recovered_at = run.answering_at + wait_for(lambda: _recovered(world), 60.0)
        if run.recovered_at != float("inf"):
            run.converged_at = run.recovered_at + wait_for(
                lambda: _within_budget(world), 3 * deadline_s
            )
        time.sleep(after_s)
        run.ungranted = _ungranted(world)
    return run


@dataclass
class FreezeRun(FaultRun):
    """An agent stopped (SIGSTOP) and continued: how soon it answered again."""

    admin_after_s: float = float("inf")
    """From SIGCONT to the answer of an admin request sent then."""
    ready_after_s: float = float("inf")
    """From SIGCONT to ``/readyz`` answering 200 to a request sent then."""
    queued_after_s: float = float("inf")
    """From SIGCONT to the answer of the last request queued while it was stopped."""
    queued_failed: int = 0
    usual_s: float = 0.0
    """What answers take under the same load just before the stop, the longest of: one
    admin request or ``/readyz`` probe at a time, and the last of the same queued requests
    sent all at once (their threads share this process and the cores with the servers)."""


def _queued(world: FaultWorld, results: list[float | None], kind: str, started: float) -> None:
    """One request sent while the agent is stopped; appends when it was answered."""
    try:
        if kind == "admin":
            AdminClient(str(world.agent.admin_socket), timeout=60.0).request(
                AdminRequest(op="list")
            )
        else:
            with urllib.request.urlopen(f"{world.agent.url}/readyz", timeout=60.0) as answer:
                answer.read()
        results.append(time.monotonic())
    except (AdminError, OSError):
        results.append(None)


def _send_queued(
    world: FaultWorld, queued: int, pause_s: float, started: float
) -> tuple[list[threading.Thread], list[float | None]]:
    """``queued`` admin requests and as many ``/readyz`` probes, one every ``pause_s``."""
    results: list[float | None] = []
    threads = [
        threading.Thread(target=_queued, args=(world, results, kind, started))
        for kind in ("admin", "ready")
        for _ in range(queued)
    ]
    for thread in threads:
        thread.start()
        time.sleep(pause_s)
    return threads, results


def _last_answer(threads: list[threading.Thread], results: list[float | None]) -> float:
    """When the last of the requests was answered (inf if one was not)."""
    for thread in threads:
        thread.join(90)
    answered = [t for t in results if t is not None]
    return max(answered) if answered and len(answered) == len(threads) else float("inf")


def agent_frozen(world: FaultWorld, stopped_s: float, queued: int = 8) -> FreezeRun:
    """SIGSTOP the agent under load for ``stopped_s`` while ``queued`` admin requests and
    ``queued`` ``/readyz`` probes wait on it, then SIGCONT: how soon it answers."""
    with under_load(world, "stopped") as (_, _, base):
        run = FreezeRun(base.name, base.budget, 0.0, {}, page=base.page)
        probes: list[Callable[[], object]] = [
            lambda: world.agent.try_view(10.0) is not None,
            lambda: world.agent.ready(10.0),
        ]
        one_at_a_time = max(wait_for(probe, 30.0) for probe in probes for _ in range(5))
        sent = time.monotonic()
        all_at_once = _last_answer(*_send_queued(world, queued, 0.0, sent)) - sent
        run.usual_s = max(one_at_a_time, all_at_once)
        _fault_begins(world, run)
        world.agent.pause()
        threads, results = _send_queued(world, queued, stopped_s / (4 * queued), run.fault_at)
        time.sleep(stopped_s / 2)
        resumed = time.monotonic()
        world.agent.resume()
        run.admin_after_s = wait_for(lambda: world.agent.try_view(10.0) is not None, 30.0)
        run.ready_after_s = wait_for(lambda: world.agent.ready(10.0), 30.0)
        run.answering_at = resumed + run.admin_after_s
        last = _last_answer(threads, results)
        run.queued_failed = sum(1 for t in results if t is None)
        run.queued_after_s = last - resumed
        run.recovered_at = resumed + wait_for(lambda: _recovered(world), 60.0)
        run.converged_at = run.recovered_at
    run.answers, run.samples, run.problems = base.answers, base.samples, base.problems
    run.ungranted = _ungranted(world)
    return run
