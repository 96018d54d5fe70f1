"""The e2e suite runs against a real cluster (KUBECONFIG) with kvshare installed.

See docs/development.md, "Testing the operator": a kind (or any) cluster, the chart
installed with the node agent on fake GPUs (``nodeAgent.fakeGpus``, i.e.
``kvshare node --fake-gpus 2x80Gi``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _needs_a_cluster(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cluster") and not os.environ.get("KUBECONFIG"):
        pytest.skip("needs a real Kubernetes cluster with kvshare installed: set KUBECONFIG")


@pytest.fixture
def kube() -> Any:
    """An API client for the cluster KUBECONFIG names."""
    from kubernetes import client, config

    config.load_kube_config()
    return client.ApiClient()


@pytest.fixture
def namespace(kube: Any) -> Iterator[str]:
    """A namespace of its own for each test, deleted afterwards."""
    from kubernetes import client

    name = f"kvshare-e2e-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(kube)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)
