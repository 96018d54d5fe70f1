"""Limits a pod cannot fork around: connections and pools count per pod (its processes
together) and in all, and an idle connection is closed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deviceplugin.trust.harness import (
    GpuNode,
    Victim,
    node_fixture,
    short_directory,
    victim,
)
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("cgroups")


def test_ten_thousand_connections_from_one_pod_stop_at_its_limit(
    node: GpuNode, steady: Victim
) -> None:
    before = steady.snapshot()
    refusals = node.refusals("limit")
    pod = node.pod("flood")
    holder, counts = pod.hold("connect", str(node.agent.broker_socket), "10000", "--wait", "1")
    try:
        assert counts["open"] == 128, counts
        assert counts["refused"] == {"limit": 10000 - 128}, counts
        assert "holds 128 connections, the most one pod may hold" in counts["reasons"][0]
        assert node.refusals("limit") == refusals + 10000 - 128
        # Another tenant's pool still comes and goes, and the victim is as it was.
        other = node.pod("neighbour", "team-c").pool(kv_min=0, static=0)
        assert other.error is None, other.error
        other.exit()
        assert steady.snapshot() == before
    finally:
        pod.release(holder)


def test_a_fork_bomb_of_pools_stops_at_the_pods_limit(node: GpuNode, steady: Victim) -> None:
    before = steady.snapshot()
    refusals = node.refusals("pool-limit")
    pod = node.pod("bomb")
    holder, counts = pod.hold("pools", str(node.agent.broker_socket), json.dumps(pod.hello()), "40")
    try:
        assert counts["welcome"] == 8 and counts["refused"] == 32, counts
        assert "already holds 8 pools, the most one pod may hold" in counts["reasons"][0]
        assert node.refusals("pool-limit") == refusals + 32
        assert sum(1 for p in node.agent.view().pools if p.pod == "bomb") == 8
        assert steady.snapshot() == before
    finally:
        pod.release(holder)
    wait_until(lambda: not any(p.pod == "bomb" for p in node.agent.view().pools),
               what="the bomb's pools to go with its processes")  # fmt: skip


@pytest.fixture(scope="module")
def strict_node(cgroups: Path) -> Iterator[GpuNode]:
    with short_directory() as directory:
        yield from node_fixture(directory, cgroups, "--hello-deadline", "1")


def test_a_connection_that_never_says_hello_is_closed_at_the_deadline(
    strict_node: GpuNode,
) -> None:
    node = strict_node
    steady = victim(node)
    before = steady.snapshot()
    refusals = node.refusals("deadline")
    pod = node.pod("mute")
    began = time.monotonic()
    answer = pod.ask("frames", str(node.agent.broker_socket), "[]", "--wait", "20")
    assert time.monotonic() - began < 15
    assert answer["closed"] and answer["replies"] == [
        {"type": "refused", "reason": "deadline: no first message within 1 s"}
    ], answer
    assert node.refusals("deadline") == refusals + 1
    assert steady.snapshot() == before
