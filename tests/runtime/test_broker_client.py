"""The broker client as a pool uses it: choosing a lease source from the environment,
admission and its refusals, start-up turns, and reconnecting to a restarted broker.

A real broker (``kvshare.deviceplugin.broker.server.Broker``) serves on a real unix socket in
this process; the runtime code under test imports nothing of it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.api.kvpolicy import revision
from kvshare.deviceplugin.broker.overrides import PodPolicy
from kvshare.deviceplugin.broker.server import Broker, BrokerConfig
from kvshare.deviceplugin.inventory import parse_fake_gpus
from kvshare.runtime.broker_client import (
    AdmissionRefusedError,
    BrokerLease,
    BrokerUnavailableError,
    PoolIdentity,
    PoolPolicy,
    StartupTurnRefusedError,
    StartupTurnTimeoutError,
    startup_turn,
)
from kvshare.runtime.lease import PoolUsage, StaticLease
from kvshare.runtime.leases import LeaseConfigError, lease_from_env

from .support import wait_until

GIB = 2**30
GPU = parse_fake_gpus("1x8Gi", "client-test")[0]


class Holder:
    def __init__(self) -> None:
        self.limits: list[int] = []
        self.lease: BrokerLease | None = None

    def lease_changed(self, limit: int) -> None:
        self.limits.append(limit)
        if self.lease is not None:  # a pool reports after every lease change
            self.lease.report(PoolUsage(mapped=0, used=0, cached=0, reserved=0))


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_broker(run_dir: Path) -> Broker:
    broker = Broker(
        [GPU],
        BrokerConfig(
            socket_path=run_dir / "broker.sock",
            state_path=run_dir / "broker.state",
            headroom=GIB,
            recovery_s=10.0,
        ),
    )
    broker.start()
    return broker


@pytest.fixture
def broker(run_dir: Path) -> Iterator[Broker]:
    broker = start_broker(run_dir)
    yield broker
    broker.stop()


def lease_for(run_dir: Path, **policy: int) -> BrokerLease:
    return BrokerLease(
        GPU.uuid,
        policy=PoolPolicy(**policy),
        identity=PoolIdentity(namespace="llm", pod="qwen-0"),
        socket_path=str(run_dir / "broker.sock"),
    )


def test_lease_from_env_picks_the_broker_a_fixed_limit_or_says_what_is_missing(
    broker: Broker, run_dir: Path
) -> None:
    socket_path = str(run_dir / "broker.sock")
    chosen = lease_from_env(
        environ={"KVSHARE_BROKER_SOCKET": socket_path, "KVSHARE_GPU_UUIDS": f"GPU-x,{GPU.uuid}",
                 "KVSHARE_KV_MIN": "1Gi", "KVSHARE_POD_NAME": "qwen-0"},
        rank=1, tp_size=2, engine="vllm",
    )  # fmt: skip
    assert isinstance(chosen, BrokerLease)
    assert chosen.gpu == GPU.uuid and chosen.policy.kv_min == GIB
    assert chosen.identity == PoolIdentity(pod="qwen-0", rank=1, tp_size=2, engine="vllm")
    absent = str(run_dir / "absent.sock")
    fixed = lease_from_env(environ={"KVSHARE_BROKER_SOCKET": absent, "KVSHARE_KV_LIMIT": "8Gi"})
    assert isinstance(fixed, StaticLease) and fixed.limit() == 8 * GIB
    with pytest.raises(LeaseConfigError, match="KVSHARE_KV_LIMIT is not set"):
        lease_from_env(environ={"KVSHARE_BROKER_SOCKET": absent})
    with pytest.raises(LeaseConfigError, match="KVSHARE_GPU_UUIDS is not set"):
        lease_from_env(environ={"KVSHARE_BROKER_SOCKET": socket_path})


def test_a_pool_is_admitted_with_its_minimum_and_grows_in_chunks(
    broker: Broker, run_dir: Path
) -> None:
    lease = lease_for(run_dir, kv_min=GIB)
    holder = Holder()
    holder.lease = lease
    lease.attach(holder)
    try:
        assert lease.limit() == GIB and lease.name == "llm/qwen-0"
        lease.want(GIB + 1)  # rounded up to a whole chunk (16 pages of 2 MiB)
        wait_until(lambda: lease.limit() == GIB + 32 * 2**20)
        assert holder.limits == [GIB + 32 * 2**20]
    finally:
        lease.close()
    wait_until(lambda: not broker.view().pools)  # the goodbye returned the lease


@pytest.mark.parametrize(("capacity", "grown"), [(6 * GIB, 4 * GIB), (None, 2 * GIB)])
def test_a_max_raised_in_place_lets_the_pool_grow_into_what_it_asked(
    broker: Broker, run_dir: Path, capacity: int | None, grown: int
) -> None:
    """A pool asks up to its capacity (its virtual size), the broker caps it at the kv max
    in force; raised in place (as its pod's annotation does), the pool gets what it asked
    without asking again. Without a capacity it never asks beyond its first max."""
    lease = BrokerLease(
        GPU.uuid,
        policy=PoolPolicy(kv_min=GIB, kv_max=2 * GIB, capacity=capacity),
        identity=PoolIdentity(
            namespace="llm", pod="qwen-0", pod_uid="0f8fad5b-d9cb-469f-a165-70867728950e"
        ),
        socket_path=str(run_dir / "broker.sock"),
    )
    holder = Holder()
    holder.lease = lease
    lease.attach(holder)
    try:
        lease.want(4 * GIB)
        wait_until(lambda: lease.limit() == 2 * GIB)
        raised = PodPolicy(revision=revision(GIB, 5 * GIB, 100), kv_min=GIB, kv_max=5 * GIB)
        broker.set_pod_policy("0f8fad5b-d9cb-469f-a165-70867728950e", raised)
        wait_until(lambda: broker.view().pools[0].kv_max == 5 * GIB)
        wait_until(lambda: lease.limit() == grown)
    finally:
        lease.close()


def grant_steps(lease: BrokerLease, wants: int) -> list[int]:
    """Ask for one byte more than the lease ``wants`` times; how much each grant added."""
    steps = []
    for _ in range(wants):
        before = lease.limit()
        lease.want(before + 1)
        wait_until(lambda: lease.limit() > before)  # noqa: B023 - used before the next turn
        steps.append(lease.limit() - before)
    return steps


def test_a_pool_that_keeps_running_out_asks_for_geometrically_more(
    broker: Broker, run_dir: Path
) -> None:
    chunk = 16 * 2 * 2**20
    hungry, calm = (
        BrokerLease(
            GPU.uuid,
            policy=PoolPolicy(),
            identity=PoolIdentity(namespace="llm", pod=pod),
            socket_path=str(run_dir / "broker.sock"),
            slow_start_window_s=window,
        )
        for pod, window in (("hungry", 60.0), ("calm", 0.0))
    )
    try:
        for lease in (hungry, calm):
            holder = Holder()
            holder.lease = lease
            lease.attach(holder)
        # Each want comes right after the last was granted in full: the step doubles, as
        # far as the lease itself (so the lease at most doubles per round trip).
        assert grant_steps(hungry, 5) == [chunk, chunk, 2 * chunk, 4 * chunk, 8 * chunk]
        assert hungry.limit() == 16 * chunk
        # Wants that come after a quiet spell (any time at all, here) grow by one chunk.
        assert grant_steps(calm, 3) == [chunk, chunk, chunk]
    finally:
        hungry.close()
        calm.close()


class ShrinkingPool:
    """A pool that, told its lease was lowered, reports what it still holds: first a usage
    taken before the lower limit was in force, then one taken after it."""

    def __init__(self, lease: BrokerLease, stale: PoolUsage, fresh: PoolUsage) -> None:
        self.lease = lease
        self.reports = [stale, fresh]
        self.limits: list[int] = []

    def lease_changed(self, limit: int) -> None:
        self.limits.append(limit)
        if len(self.limits) == 2 and self.reports:  # the reclaim (after the first grant)
            self.lease.report(self.reports.pop(0))

    def report_next(self) -> None:
        self.lease.report(self.reports.pop(0))


def test_a_reclaimed_pool_hands_on_what_it_released_before_it_is_done(
    broker: Broker, run_dir: Path
) -> None:
    big, waiter = lease_for(run_dir, kv_min=0), lease_for(run_dir, kv_min=0)
    budget = 7 * GIB  # 8 GiB fake GPU, 1 GiB headroom
    half = budget // 2
    old_limit = PoolUsage(mapped=6 * GIB, used=6 * GIB, cached=0, reserved=0, limit=budget)
    new_limit = PoolUsage(mapped=5 * GIB, used=5 * GIB, cached=0, reserved=0, limit=half)
    pool = ShrinkingPool(big, stale=old_limit, fresh=new_limit)
    big.attach(pool)
    waiter_holder = Holder()
    waiter.attach(waiter_holder)
    try:
        big.want(budget)
        wait_until(lambda: big.limit() == budget)
        big.report(PoolUsage(mapped=budget, used=budget, cached=0, reserved=0, limit=budget))
        wait_until(lambda: broker.view().pools[0].used == budget)
        waiter.want(budget)  # same priority: half each, the big pool's blocks in use or not
        wait_until(lambda: big.limit() == half)
        # The numbers taken under the old limit moved nothing (the pool may have grown).
        wait_until(lambda: broker.view().pools[0].mapped == 6 * GIB)
        assert waiter.limit() == 0
        pool.report_next()  # taken under the lowered limit: 2 GiB are free already
        wait_until(lambda: waiter.limit() == 2 * GIB)
        big.report(PoolUsage(mapped=half, used=half, cached=0, reserved=0, limit=half))
        wait_until(lambda: waiter.limit() == half)
    finally:
        big.close()
        waiter.close()


def test_refusals_and_a_missing_broker_are_clear_errors(broker: Broker, run_dir: Path) -> None:
    with pytest.raises(AdmissionRefusedError, match=r"fit: static 0 \+ kv min 64.0Gi"):
        lease_for(run_dir, kv_min=64 * GIB).attach(Holder())
    missing = BrokerLease(GPU.uuid, policy=PoolPolicy(), socket_path=str(run_dir / "x.sock"))
    with pytest.raises(BrokerUnavailableError, match="is the kvshare node agent running"):
        missing.attach(Holder())


def test_startup_turns_wait_time_out_and_refuse_what_cannot_fit(
    broker: Broker, run_dir: Path
) -> None:
    socket_path = str(run_dir / "broker.sock")
    with startup_turn(GPU.uuid, static_bytes=GIB, socket_path=socket_path) as turn:
        assert turn.hold_s > 0
        assert turn.gpu_total == GPU.total_bytes
        waiting = startup_turn(GPU.uuid, socket_path=socket_path, timeout_s=0.3)
        with pytest.raises(StartupTurnTimeoutError, match="KVSHARE_STARTUP_TIMEOUT"):
            waiting.__enter__()
    too_big = startup_turn(GPU.uuid, static_bytes=100 * GIB, socket_path=socket_path)
    with pytest.raises(StartupTurnRefusedError, match="does not fit"):
        too_big.__enter__()


def test_a_pool_reconnects_and_re_declares_to_a_restarted_broker(run_dir: Path) -> None:
    broker = start_broker(run_dir)
    lease = lease_for(run_dir, kv_min=GIB)
    holder = Holder()
    holder.lease = lease
    lease.attach(holder)
    try:
        lease.want(3 * GIB)
        wait_until(lambda: lease.limit() == 3 * GIB)
        broker.stop()
        wait_until(lambda: not lease.connected())
        assert lease.limit() == 3 * GIB  # the pool keeps its lease while the broker is away
        broker = start_broker(run_dir)
        wait_until(lease.connected, timeout=30)
        wait_until(lambda: [p.lease for p in broker.view().pools] == [3 * GIB])
        assert not broker.view().recovering
    finally:
        lease.close()
        broker.stop()


def test_the_runtime_side_never_imports_the_node_agent() -> None:
    code = (
        "import sys, kvshare.runtime.broker_client, kvshare.runtime.leases; "
        "bad = [m for m in sys.modules if m.startswith(('kvshare.deviceplugin', "
        "'kvshare.operator', 'grpc', 'prometheus_client', 'kubernetes', 'pydantic'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
