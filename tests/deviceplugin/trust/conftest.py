"""Fixtures of the hostile-tenant suite (see :mod:`.harness`): one node, and one other
tenant's pool on it, shared by the modules whose tests need no agent of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deviceplugin.trust.harness import (
    GpuNode,
    Victim,
    node_fixture,
    pod_cgroup_root,
    short_directory,
    victim,
)


@pytest.fixture(scope="session")
def cgroups() -> Path:
    root = pod_cgroup_root()
    if root is None:
        pytest.skip(
            "stand-in pods need root and a writable cgroup hierarchy to put their processes "
            "in pod cgroups (kubepods/.../pod<uid>), as the kubelet does"
        )
    return root


@pytest.fixture(scope="session")
def node(cgroups: Path) -> Iterator[GpuNode]:
    """The node most tests attack: namespaces may use KV priority 300 (team-gold 900), a
    pod at most 8 pools, each GPU has 32 slots (every test's pods get their own)."""
    with short_directory() as directory:
        yield from node_fixture(
            directory, cgroups, "--kv-priority-default", "300", "--kv-priority", "team-gold=900",
            "--max-pools-per-pod", "8", "--slots-per-gpu", "32",
        )  # fmt: skip


@pytest.fixture(scope="session")
def steady(node: GpuNode) -> Victim:
    """Team B's pool, which no test may move."""
    return victim(node)
