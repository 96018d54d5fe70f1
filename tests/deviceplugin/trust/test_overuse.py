"""Leases enforced where the hardware tells: on a GPU node (NVML faked, only its calls:
:mod:`tests.deviceplugin.fake_nvml.pynvml`), a pool whose process holds more device memory
than the broker charges it for is warned (Event on its pod), counted, reclaimed, and
evicted when it keeps on; a pool within its charge and tolerance, and the other tenants,
are left alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.deviceplugin.inventory import GpuInfo
from tests.deviceplugin.trust.harness import (
    GIB,
    MIB,
    GpuNode,
    node_fixture,
    short_directory,
    victim,
)
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("cgroups")

GPUS = [
    GpuInfo(uuid="GPU-5a9c4c61-0d2e-4c43-9d53-6a3e0c1b7f00", index=0, name="NVIDIA H100",
            total_bytes=16 * GIB),
    GpuInfo(uuid="GPU-5a9c4c61-0d2e-4c43-9d53-6a3e0c1b7f01", index=1, name="NVIDIA H100",
            total_bytes=16 * GIB),
]  # fmt: skip
TOLERANCE = 64 * MIB


@pytest.fixture
def node(cgroups: Path) -> Iterator[GpuNode]:
    with short_directory() as directory:
        yield from node_fixture(
            directory, cgroups, "--audit-interval", "0.2", "--overuse-evict-after", "4",
            "--overuse-tolerance", "64Mi", nvml=GPUS,
        )  # fmt: skip


def overuse_count(node: GpuNode, action: str) -> float:
    lines = node.metric_lines(f'action="{action}"')
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if "lease_overuse_total" in line)


def test_a_process_over_its_charge_is_warned_reclaimed_and_then_evicted(node: GpuNode) -> None:
    steady = victim(node)
    before = steady.snapshot()
    pod = node.pod("hog", memory_gib=6)
    pool = pod.pool(static=GIB, kv_min=512 * MIB, kv_max=4 * GIB)
    assert pool.error is None, pool.error
    pool.demand(2 * GIB)
    wait_until(lambda: node.pool_view(pool.name).lease >= 2 * GIB, what="the hog's lease")
    gpu = node.pool_view(pool.name).gpu

    # Its minimum in use beside its static memory: within its charge, nothing happens.
    node.set_device_memory({(gpu, pool.pid): GIB + 512 * MIB})
    wait_until(lambda: node.pool_view(pool.name).device_bytes == 512 * MIB, what="an audit")
    assert overuse_count(node, "reclaim") == 0

    # 1 GiB beyond anything it may be charged (its max): reclaimed, warned, counted.
    lease = node.pool_view(pool.name).lease
    node.set_device_memory({(gpu, pool.pid): GIB + 4 * GIB + GIB})
    event = wait_until(
        lambda: [e for e in node.cluster.events() if e["reason"] == "KVLeaseOverused"],
        what="a KVLeaseOverused Event",
    )[0]
    assert event["involvedObject"]["name"] == "hog" and event["type"] == "Warning"
    assert "more than its charge and the tolerance" in event["message"]
    assert overuse_count(node, "reclaim") >= 1
    wait_until(lambda: node.pool_view(pool.name).lease < lease, what="its lease reclaimed")

    # It keeps holding it: after 4 audits in a row, the pod is evicted.
    evictions = wait_until(
        lambda: [c for c in node.cluster.kube.api_calls if c.resource == "pods/eviction"],
        what="the eviction",
    )
    assert (evictions[0].namespace, evictions[0].name) == ("team-a", "hog")
    assert [e for e in node.cluster.events() if e["reason"] == "KVLeaseEvicted"]
    assert overuse_count(node, "evict") == 1
    assert steady.snapshot() == before
