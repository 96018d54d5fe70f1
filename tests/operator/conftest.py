"""Fixtures: a fresh emulated API server per test, and operator processes against it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import kmock
import pytest
import pytest_asyncio

from kvshare.operator.rbac import API_CALLS
from tests.operator.harness import Cluster, OperatorProcess, write_kubeconfig
from tests.operator.kube import ApiCall, KubeCluster, declare_resources

PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    emulator = KubeCluster()
    declare_resources(emulator)
    async with emulator, kmock.Server(emulator) as server:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url))
        api = Cluster(emulator, server, kubeconfig)
        await api.create(
            PEERINGS,
            {
                "apiVersion": "kopf.dev/v1",
                "kind": "ClusterKopfPeering",
                "metadata": {"name": "kvshare"},
            },
        )
        yield api


@pytest.fixture
def start_operator(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    started: list[OperatorProcess] = []

    def start(identity: str = "operator-a", *extra: str) -> OperatorProcess:
        log = tmp_path / f"{identity}.log"
        process = OperatorProcess(cluster.kubeconfig, log, identity, *extra)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process.poll() is None:
            process.kill()
    assert undeclared(cluster.emulator.api_calls) == set(), (
        "the operator made API calls kvshare.operator.rbac does not list (RBAC would refuse them)"
    )


def undeclared(calls: list[ApiCall]) -> set[tuple[str, str, str]]:
    """Calls made by the operator (kopf's or its own client) that API_CALLS lacks."""
    declared = {(c.group, c.resource, verb) for c in API_CALLS for verb in c.verbs}
    made = {
        (call.group, call.resource, call.verb)
        for call in calls
        if call.user_agent.startswith(("kopf/", "kvshare-operator/")) and call.resource
    }
    return made - declared
