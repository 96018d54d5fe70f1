"""The admin socket is the node operators', not the pods': it is not in the directory
pods get mounted, only the agent's user may enter its directory, and a request from a
pod's container is refused even by root, counted, and changes nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvshare.api import names
from tests.deviceplugin.trust.harness import (
    GpuNode,
    Victim,
)

pytestmark = pytest.mark.usefixtures("cgroups")


def test_the_admin_socket_and_restart_file_are_not_where_pods_are_mounted(
    node: GpuNode, steady: Victim
) -> None:
    slot = node.kubelet.healthy(names.RESOURCE_GPU)[-1]
    allocation = node.kubelet.allocate(names.RESOURCE_GPU, [slot])
    mounted = [Path(m.host_path).resolve() for m in allocation.mounts]
    assert mounted == [node.agent.broker_socket.parent.resolve()]
    private = node.agent.admin_socket.parent
    for path in (node.agent.admin_socket, private / names.STATE_FILE_NAME):
        assert path.exists() and not any(m in path.resolve().parents for m in mounted)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(node.agent.admin_socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(private / names.STATE_FILE_NAME).st_mode) == 0o600
    assert steady.pod.name in (private / names.STATE_FILE_NAME).read_text()


def test_a_pod_that_reaches_the_admin_socket_is_refused_even_as_root(
    node: GpuNode, steady: Victim
) -> None:
    before_books = steady.snapshot()
    pod = node.pod("curious")
    before = node.refusals("admin")
    answer = pod.ask("admin", str(node.agent.admin_socket))
    assert answer == {
        "error": "admin requests are only taken from the node agent's own container"
    }, answer
    assert node.refusals("admin") == before + 1
    # The agent's own container (this test's mount namespace) is served.
    assert steady.snapshot() == before_books
