"""Fixtures of the hostile-tenant suite (see :mod:`.harness`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deviceplugin.trust.harness import pod_cgroup_root


@pytest.fixture(scope="module")
def cgroups() -> Path:
    root = pod_cgroup_root()
    if root is None:
        pytest.skip(
            "stand-in pods need root and a writable cgroup hierarchy to put their processes "
            "in pod cgroups (kubepods/.../pod<uid>), as the kubelet does"
        )
    return root
