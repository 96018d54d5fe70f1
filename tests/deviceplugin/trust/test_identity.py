"""A pool is who the pod it runs in is, and holds what that pod was given: a live node
agent under Kubernetes refuses every pool whose hello says otherwise, counts the refusal,
and leaves the other tenants' pools as they were.

Each hostile pod below runs its process in a real pod cgroup and mount namespace of its
own (see :mod:`tests.deviceplugin.trust.harness` for what stands in)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deviceplugin.conftest import ROOT
from tests.deviceplugin.trust.harness import (
    GIB,
    GpuNode,
    Victim,
)

pytestmark = pytest.mark.usefixtures("cgroups")


@pytest.fixture
def untouched(steady: Victim) -> Iterator[None]:
    """The test must leave the victim's lease, metrics and status as they were."""
    before = steady.snapshot()
    yield
    after = steady.snapshot()
    assert after[0] == before[0]
    assert sorted(set(after[1]) ^ set(before[1])) == []
    assert after[2] == before[2]


def refused(answer: dict[str, Any]) -> str:
    """The reason of the one ``refused`` reply to a hello (fails otherwise)."""
    replies = answer["replies"]
    assert answer["closed"] and len(replies) == 1, answer
    assert replies[0]["type"] == "refused", replies
    return str(replies[0]["reason"])


def test_a_pool_in_its_own_pod_is_admitted_with_the_pods_names(
    node: GpuNode, steady: Victim
) -> None:
    view = node.pool_view(steady.pool.name)
    assert (view.namespace, view.pod, view.pod_uid, view.modelserver) == (
        "team-b", "victim", steady.pod.uid, "steady",
    )  # fmt: skip


@pytest.mark.usefixtures("untouched")
def test_a_hello_without_a_pod_uid_is_refused(node: GpuNode) -> None:
    pod = node.pod("no-uid")
    before = node.refusals("pod-uid")
    reason = refused(pod.frames(pod.hello(pod_uid="")))
    assert reason.startswith("identity: the message carries no pod UID") and pod.uid in reason
    assert node.refusals("pod-uid") == before + 1


@pytest.mark.usefixtures("untouched")
def test_a_hello_with_another_pods_uid_is_refused(node: GpuNode, steady: Victim) -> None:
    pod = node.pod("impostor")
    before = node.refusals("pod-uid")
    reason = refused(pod.frames(pod.hello(pod_uid=steady.pod.uid, namespace="team-b",
                                          pod="victim", modelserver="steady")))  # fmt: skip
    assert f"names pod {steady.pod.uid}" in reason and f"runs in pod {pod.uid}" in reason
    assert node.refusals("pod-uid") == before + 1


@pytest.mark.usefixtures("untouched")
def test_a_process_in_no_pod_is_refused_at_once(node: GpuNode, steady: Victim) -> None:
    # This test's own process runs in no pod's cgroup (the node's host processes don't).
    before = node.refusals("no-pod")
    body = steady.pod.hello(pod="victim")
    done = subprocess.run(
        [sys.executable, "-m", "tests.deviceplugin.trust.tenant", "frames",
         str(node.agent.broker_socket), json.dumps([body])],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    reason = refused(json.loads(done.stdout))
    assert reason.startswith("identity: cannot tell which pod process") and "names no pod" in reason
    assert node.refusals("no-pod") == before + 1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"namespace": "team-b"}, "namespace 'team-b'"),
        ({"pod": "victim"}, "pod 'victim'"),
        ({"modelserver": "steady"}, "modelserver 'steady'"),
    ],
    ids=["namespace", "pod", "modelserver"],
)
@pytest.mark.usefixtures("untouched")
def test_names_that_differ_from_the_pods_are_refused(
    node: GpuNode, fields: dict[str, str], named: str
) -> None:
    pod = node.pod(f"liar-{next(iter(fields))}", modelserver="honest")
    before = node.refusals("names")
    reason = refused(pod.frames(pod.hello(**fields)))
    assert reason.startswith("identity: the hello declares") and named in reason
    assert f"pod team-a/{pod.name}" in reason
    assert node.refusals("names") == before + 1


@pytest.mark.usefixtures("untouched")
def test_names_left_empty_are_taken_from_the_pod(node: GpuNode) -> None:
    pod = node.pod("quiet", modelserver="chat")
    answer = pod.frames(pod.hello(namespace="", pod="", modelserver=""), wait=2.0)
    [welcome] = answer["replies"]
    assert welcome["type"] == "welcome" and welcome["name"] == "team-a/quiet"


@pytest.mark.usefixtures("untouched")
def test_a_gpu_outside_the_pods_slots_is_refused(node: GpuNode) -> None:
    pod = node.pod("wanderer")
    other = next(g.uuid for g in node.agent.gpus if g.uuid not in pod.gpus)
    before = node.refusals("gpu")
    reason = refused(pod.frames(pod.hello(gpu=other)))
    assert reason.startswith(f"allocation: GPU {other} is not one of the GPUs")
    assert pod.gpus[0] in reason
    assert node.refusals("gpu") == before + 1


@pytest.mark.parametrize(
    ("static", "kv_min"), [(GIB, 4 * GIB), (5 * GIB, 0)], ids=["kv_min", "static"]
)
@pytest.mark.usefixtures("untouched")
def test_memory_beyond_the_pods_gpu_memory_request_is_refused(
    node: GpuNode, static: int, kv_min: int
) -> None:
    pod = node.pod(f"greedy-{kv_min // GIB}", memory_gib=4)
    before = node.refusals("memory")
    reason = refused(pod.frames(pod.hello(static=static, kv_min=kv_min)))
    assert reason.startswith("allocation: static + kv min") and "request of 4.0Gi" in reason
    assert node.refusals("memory") == before + 1


@pytest.mark.usefixtures("untouched")
def test_the_pods_pools_share_its_request(node: GpuNode) -> None:
    pod = node.pod("two-pools", memory_gib=4)
    first = pod.pool(static=GIB, kv_min=2 * GIB)
    assert first.error is None, first.error
    second = pod.pool(static=GIB, kv_min=GIB, pod=pod.name)
    assert second.error is not None and "with 3.0Gi of the pod's other pools" in second.error


@pytest.mark.usefixtures("untouched")
def test_a_priority_above_the_namespaces_ceiling_runs_at_the_ceiling(node: GpuNode) -> None:
    pod = node.pod("loud")
    pool = pod.pool(priority=1000)
    assert pool.error is None, pool.error
    assert node.pool_view(pool.name).priority == 300
    gold = node.pod("gold", namespace="team-gold").pool(priority=800)
    assert node.pool_view(gold.name).priority == 800


@pytest.mark.usefixtures("untouched")
def test_a_pod_the_api_does_not_know_is_refused_after_waiting(node: GpuNode) -> None:
    pod = node.pod("ghost")
    node.cluster.request("DELETE", f"/api/v1/namespaces/team-a/pods/{pod.name}")
    before = node.refusals("unknown-pod")
    reason = refused(pod.frames(pod.hello(), wait=10.0))
    assert reason.startswith(f"identity: pod {pod.uid} is not known: no pod with this UID")
    assert node.refusals("unknown-pod") == before + 1
