"""Tensor-parallel ownership with real rank processes, through the public entry points.

Local ownership (SGLang: one scheduler per rank): every rank's pool maps its own null-block
page exactly once and sends nothing to any other rank, while the real TP size is carried.
Coordinated ownership (vLLM: one scheduler, the owner, in this test process): every rank
maps exactly the owner's pages, each rank's lease bounds the group, and a killed or hung
rank is an error to the owner within the timeout.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshare.runtime.coordinated import CoordinatedOwnership
from kvshare.runtime.errors import PeerError, PoolError
from kvshare.runtime.pool import KVPool

from .tp_rank import GEOMETRY

ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = GEOMETRY.page_bytes
TIMEOUT = 60.0


class RankProcess:
    """A rank's process; its stdout lines arrive on a queue."""

    def __init__(
        self,
        mode: str,
        *,
        group: str,
        rank: int,
        world_size: int,
        namespace: str,
        limit_pages: int = 64,
    ) -> None:
        self.rank = rank
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.runtime.tp_rank",
                "--mode",
                mode,
                "--group",
                group,
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--namespace",
                namespace,
                "--limit-pages",
                str(limit_pages),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self) -> str:
        try:
            return self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            self.stderr.seek(0)
            raise AssertionError(
                f"rank {self.rank} said nothing: {self.stderr.read()[-3000:]}"
            ) from None

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self.expect())
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def abstract_sockets(namespace: str) -> list[str]:
    """Unix sockets of this machine bound in the abstract namespace under ``namespace``."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    names = [line.split()[-1] for line in lines if len(line.split()) == 8]
    return [name for name in names if name.startswith(f"@{namespace}/")]


@pytest.fixture
def namespace() -> str:
    """Keeps this test's rank sockets apart from any other run's."""
    return f"kvs-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def ranks(namespace: str) -> Iterator[list[RankProcess]]:
    started: list[RankProcess] = []
    yield started
    for rank in started:
        if rank.proc.poll() is None and rank.proc.returncode is None:
            os.kill(rank.proc.pid, signal.SIGCONT)
        rank.stop()


def start_ranks(
    ranks: list[RankProcess], namespace: str, world_size: int, limits: list[int] | None = None
) -> None:
    for rank in range(world_size):
        limit = limits[rank] if limits else 64
        ranks.append(
            RankProcess(
                "coordinated",
                group="g1",
                rank=rank,
                world_size=world_size,
                namespace=namespace,
                limit_pages=limit,
            )
        )
    for rank in ranks:
        assert rank.expect() == "ready"


def owner_pool(
    namespace: str, world_size: int, timeout_s: float = TIMEOUT, reserve_pages: int = 2
) -> KVPool:
    ownership = CoordinatedOwnership("g1", world_size, namespace=namespace, timeout_s=timeout_s)
    return KVPool(GEOMETRY, None, ownership.group_lease(), ownership, reserve_pages=reserve_pages)


def test_local_ranks_map_their_own_null_page_once_and_send_nothing(namespace: str) -> None:
    world_size = 4
    procs = [
        RankProcess("local", group="g1", rank=r, world_size=world_size, namespace=namespace)
        for r in range(world_size)
    ]
    try:
        results = [json.loads(p.expect()) for p in procs]
    finally:
        for p in procs:
            p.proc.wait(timeout=TIMEOUT)
            p.stderr.close()
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world_size"] == world_size
        assert result["page0_maps"] == [1] * GEOMETRY.num_buffers  # no duplicate null-page map
        assert result["max_maps_per_address"] >= 1
        assert result["sockets"] == 0  # no connection to any other rank
        assert 0 in result["mapped"]
    assert abstract_sockets(namespace) == []  # nobody listened either


def test_coordinated_ranks_map_exactly_the_owners_pages(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=4)
    pool = owner_pool(namespace, 4)
    try:
        rng = random.Random(7)
        live: list[list[int]] = []
        for _ in range(300):
            if live and rng.random() < 0.45:
                pool.free(live.pop(rng.randrange(len(live))))
            else:
                ids = pool.alloc(rng.randint(1, 24))
                if ids:
                    live.append(ids)
        pool.maintain()
        expected = sorted(pool.mapped_pages())
        assert len(expected) > 3
        for rank in ranks:
            state = rank.ask("dump")
            assert state["mapped"] == expected
            assert state["intact"]
            assert state["page0_maps"] == [1] * GEOMETRY.num_buffers
            assert state["mapped_bytes"] == len(expected) * PAGE_BYTES
    finally:
        pool.close()
    for rank in ranks:  # the owner is gone: every rank gives its memory back
        deadline = time.monotonic() + TIMEOUT
        while rank.ask("state")["mapped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank.ask("state")["mapped"] == []


def test_the_smallest_rank_lease_bounds_the_group_and_a_reclaim_shrinks_every_rank(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=2, limits=[12, 8])
    pool = owner_pool(namespace, 2)
    try:
        assert pool.snapshot().lease == 8 * PAGE_BYTES
        ids = pool.alloc(pool.available())
        assert ids and pool.snapshot().held == 8 * PAGE_BYTES
        pool.free(ids[GEOMETRY.page_size // GEOMETRY.block_bytes * 2 :])  # keep ~2 pages used
        ranks[0].ask(f"lower {3 * PAGE_BYTES}")
        deadline = time.monotonic() + TIMEOUT
        while pool.snapshot().held > 3 * PAGE_BYTES and time.monotonic() < deadline:
            time.sleep(0.05)
        expected = sorted(pool.mapped_pages())
        assert len(expected) <= 3
        for rank in ranks:
            assert rank.ask("dump")["mapped"] == expected
    finally:
        pool.close()


def test_a_rank_hears_its_reclaim_is_in_force_only_once_the_owner_applies_it(
    ranks: list[RankProcess], namespace: str
) -> None:
    """A rank acknowledges its broker's reclaim from the owner's reports; while the owner's
    scheduler holds its lease steady, those reports still carry the old lease."""
    start_ranks(ranks, namespace, world_size=2, limits=[8, 8])
    pool = owner_pool(namespace, 2)

    def report_after(count: int) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT
        while (latest := ranks[0].ask("reports"))["count"] <= count:
            assert time.monotonic() < deadline, "the owner's report did not reach rank 0"
            time.sleep(0.02)
        return latest

    try:
        with pool.steady_lease():
            ranks[0].ask(f"lower {3 * PAGE_BYTES}")
            deadline = time.monotonic() + TIMEOUT
            while pool.lease.limit() > 3 * PAGE_BYTES:  # the group heard of it
                assert time.monotonic() < deadline, "the reclaim did not reach the owner"
                time.sleep(0.02)
            seen = ranks[0].ask("reports")["count"]
            pool.maintain()  # reports go to every rank
            assert report_after(seen)["limit"] == 8 * PAGE_BYTES
        seen = ranks[0].ask("reports")["count"]
        pool.maintain()
        assert report_after(seen)["limit"] == 3 * PAGE_BYTES
    finally:
        pool.close()


def test_a_killed_rank_is_an_error_to_the_owner_within_the_timeout(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=2)
    pool = owner_pool(namespace, 2, timeout_s=5.0)
    try:
        assert pool.alloc(10)
        ranks[1].proc.kill()
        ranks[1].proc.wait()
        start = time.monotonic()
        with pytest.raises(PeerError, match="rank 1"):
            while time.monotonic() - start < 5.0:
                pool.alloc(GEOMETRY.page_size // GEOMETRY.block_bytes)  # grows: talks to ranks
        assert time.monotonic() - start < 5.0
    finally:
        pool.close()


def test_a_hung_rank_is_an_error_to_the_owner_after_the_timeout(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=2)
    pool = owner_pool(namespace, 2, timeout_s=2.0)
    try:
        pool.maintain()
        os.kill(ranks[0].proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"rank 0 .*no answer to '\w+' within 2 s"):
            pool.alloc(pool.available())
        assert 2.0 <= time.monotonic() - start < 20.0
        with pytest.raises(PeerError):  # the pool refuses further work: its ranks are out of step
            pool.alloc(1)
    finally:
        os.kill(ranks[0].proc.pid, signal.SIGCONT)
        pool.close()


def test_an_owner_with_another_geometry_or_size_is_refused(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=2)
    with pytest.raises(PeerError, match="is not listening"):
        CoordinatedOwnership("g1", 3, namespace=namespace, connect_timeout_s=0.3)
    ownership = CoordinatedOwnership("g1", 2, namespace=namespace)
    other = type(GEOMETRY)(num_buffers=2, block_bytes=4096, num_blocks=400, page_size=16384)
    with pytest.raises(PoolError, match="differs from this rank's"):
        KVPool(other, None, ownership.group_lease(), ownership)
    ownership.close()


def test_every_rank_keeps_a_freed_page_mapped_until_its_own_device_work_is_done(
    ranks: list[RankProcess], namespace: str
) -> None:
    start_ranks(ranks, namespace, world_size=2)
    pool = owner_pool(namespace, 2, reserve_pages=0)
    try:
        per_page = GEOMETRY.page_size // GEOMETRY.block_bytes
        ids = pool.alloc(2 * per_page)  # page 0 (with the null block) and page 1
        assert ids
        block = max(ids)
        page = GEOMETRY.page_of(block)
        assert page != 0
        assert ranks[1].ask(f"launch {block}") == {"launched": block}  # still reads it
        pool.free([b for b in ids if GEOMETRY.page_of(b) == page])
        ranks[0].ask(f"lower {1 * PAGE_BYTES}")  # the broker reclaims: the pool's thread acts
        deadline = time.monotonic() + TIMEOUT
        while page in ranks[0].ask("state")["mapped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert page not in ranks[0].ask("state")["mapped"]  # nothing in flight on rank 0
        assert page in ranks[1].ask("state")["mapped"], "unmapped under rank 1's work"
        assert ranks[1].ask("finish") == {"read": 2}  # no fault, no stale read
        while page in ranks[1].ask("state")["mapped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert page not in ranks[1].ask("state")["mapped"]
    finally:
        pool.close()
