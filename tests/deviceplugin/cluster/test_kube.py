"""The node agent against a Kubernetes API: ``kmock``'s emulator served over real HTTP,
used by the real ``kubernetes`` client (the KVShareNode publisher, the pending-pod
lookup, and the RBAC the agent declares for both)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from kubernetes import client

from kvshare.api import names
from kvshare.api.kvsharenode import KVShareNodeStatus
from kvshare.api.wire import Hello, Report
from kvshare.deviceplugin.admin.metrics import NodeMetrics
from kvshare.deviceplugin.agent import AgentConfig, NodeAgent
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.cluster.pods import NodePods
from kvshare.deviceplugin.cluster.publisher import (
    RBAC_RULES,
    KVShareNodePublisher,
    status_from_view,
)
from kvshare.deviceplugin.inventory import parse_fake_gpus
from kvshare.deviceplugin.kubelet.kubelet_standin import StandInKubelet
from tests.deviceplugin.conftest import GIB, wait_until

NODE = "test-node"
GPUS = parse_fake_gpus("2x16Gi", NODE)
KVSHARENODES = f"{names.GROUP}/{names.VERSION}/{names.KVSHARENODE_PLURAL}"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class Emulator:
    """kmock's KubernetesEmulator over HTTP, on its own thread and event loop."""

    def __init__(self) -> None:
        self.kmock = kmock.KubernetesEmulator()
        self.kmock.resources[KVSHARENODES] = kmock.ResourceInfo(
            kind=names.KVSHARENODE_KIND, namespaced=False, subresources={"status"}, verbs=VERBS
        )
        self.kmock.resources["v1/nodes"] = kmock.ResourceInfo(
            kind="Node", namespaced=False, verbs=VERBS
        )
        self.kmock.resources["v1/pods"] = kmock.ResourceInfo(
            kind="Pod", namespaced=True, subresources={"status"}, verbs=VERBS
        )
        self.kmock.resources["v1/events"] = kmock.ResourceInfo(
            kind="Event", namespaced=True, verbs=VERBS
        )
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),))

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        async with self.kmock, kmock.Server(self.kmock) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stopped.wait()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30)

    def stop(self) -> None:
        assert self._stopped is not None
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(30)

    def post(self, path: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=10).read()

    def patch(self, path: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.url + path,
            json.dumps(body).encode(),
            {"Content-Type": "application/merge-patch+json"},
            method="PATCH",
        )
        urllib.request.urlopen(request, timeout=10).read()

    def delete(self, path: str) -> None:
        urllib.request.urlopen(
            urllib.request.Request(self.url + path, method="DELETE"), timeout=10
        ).read()

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def requests(self) -> list[Any]:
        """Every request the emulator served, in order."""
        return list(self.kmock)


@pytest.fixture
def api() -> Iterator[Emulator]:
    emulator = Emulator()
    emulator.start()
    yield emulator
    emulator.stop()


def api_client(emulator: Emulator) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = emulator.url
    return client.ApiClient(configuration)


def books_with_a_pool() -> Books:
    books = Books(GPUS, headroom=GIB // 2)
    hello = Hello(version=1, gpu=GPUS[1].uuid, page_size=2 * 2**20, kv_min=GIB, kv_max=8 * GIB,
                  priority=300, static=4 * GIB, namespace="llm", pod="qwen-0",
                  modelserver="qwen", engine="vllm")  # fmt: skip
    admission = books.admit(hello, 1234, 0.0)
    assert admission.record is not None
    books.want(admission.record.id, 1, 3 * GIB, 0.0)
    books.report(admission.record.id, Report(mapped=2 * GIB, used=GIB, cached=0, reserved=0), 0.0)
    return books


def kvsharenode_path() -> str:
    return f"/apis/{KVSHARENODES}/{NODE}"


def test_the_publisher_creates_the_kvsharenode_and_writes_its_status(api: Emulator) -> None:
    api.post("/api/v1/nodes", {"metadata": {"name": NODE, "uid": "node-uid-1"}})
    books = books_with_a_pool()
    publisher = KVShareNodePublisher(
        api_client(api), NODE, lambda: status_from_view(books.view(0), "host", 8), NodeMetrics()
    )
    assert publisher.publish(now=0.0)
    stored = api.get(kvsharenode_path())
    assert stored["spec"] == {"nodeName": NODE}
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1"}
    ]
    status = KVShareNodeStatus.model_validate(stored["status"])
    assert status.gpu_count == 2 and status.pool_count == 1 and status.backend == "host"
    gpu = status.gpus[1]
    assert (gpu.static, gpu.kv_min, gpu.kv_lease, gpu.kv_mapped) == (4 * GIB, GIB, 3 * GIB, 2 * GIB)
    assert gpu.free == 16 * GIB - GIB // 2 - 4 * GIB - GIB
    assert gpu.slots == 8 and gpu.slots_used == 1
    [pool] = gpu.pools
    assert (pool.namespace, pool.pod, pool.modelserver, pool.lease) == (
        "llm",
        "qwen-0",
        "qwen",
        3 * GIB,
    )
    # Nothing changed: nothing written. A change (or the heartbeat) is written.
    assert not publisher.publish(now=1.0)
    books.report(1, Report(mapped=3 * GIB, used=2 * GIB, cached=0, reserved=0), 2.0)
    assert publisher.publish(now=2.0)
    assert (
        KVShareNodeStatus.model_validate(api.get(kvsharenode_path())["status"]).gpus[1].kv_mapped
        == 3 * GIB
    )
    assert publisher.publish(now=2.0 + 61.0)  # heartbeat


def test_the_publisher_recreates_a_kvsharenode_deleted_behind_its_back(api: Emulator) -> None:
    books = books_with_a_pool()
    publisher = KVShareNodePublisher(
        api_client(api), NODE, lambda: status_from_view(books.view(0), "host", 8), NodeMetrics()
    )
    assert publisher.publish(now=0.0)  # no Node object readable: created without an owner
    assert "ownerReferences" not in api.get(kvsharenode_path())["metadata"]
    api.delete(kvsharenode_path())
    books.report(1, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 1.0)
    assert publisher.publish(now=1.0)
    assert api.get(kvsharenode_path())["status"]["gpus"][1]["kvMapped"] == "1Gi"


def test_status_writes_are_coalesced_to_the_publish_interval(api: Emulator) -> None:
    books = books_with_a_pool()
    lock = threading.Lock()
    publisher = KVShareNodePublisher(
        api_client(api), NODE,
        lambda: status_from_view(_locked_view(books, lock), "host", 8),
        NodeMetrics(), interval_s=0.5,
    )  # fmt: skip
    publisher.start()
    try:
        deadline = time.monotonic() + 3.0
        mapped = 0
        while time.monotonic() < deadline:  # a change every 5 ms: ~600 changes
            mapped = (mapped + 2 * 2**20) % (3 * GIB)
            with lock:
                books.report(1, Report(mapped=mapped, used=0, cached=0, reserved=0), 0.0)
            time.sleep(0.005)
    finally:
        publisher.stop()
    patches = [r for r in api.requests() if r.method == kmock.method.PATCH]
    assert 2 <= len(patches) <= 3.0 / 0.5 + 2


def _locked_view(books: Books, lock: threading.Lock) -> Any:
    with lock:
        return books.view(0)


def _pod(name: str, created: str, gpus: str, size: int, node: str = NODE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "annotations": {names.ANNOTATION_GPUS: gpus},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "engine", "resources": {"limits": {names.RESOURCE_GPU: str(size)}}}
            ],
        },
        "status": {"phase": "Pending"},
    }


def test_pending_pods_hand_out_planned_gpus_oldest_first_and_once(api: Emulator) -> None:
    a, b, c, d = (g.uuid for g in parse_fake_gpus("4x80Gi", NODE))
    api.post("/api/v1/namespaces/llm/pods", _pod("newer", "2026-01-01T10:00:05Z", f"{c},{d}", 2))
    api.post("/api/v1/namespaces/llm/pods", _pod("older", "2026-01-01T10:00:00Z", f"{a},{b}", 2))
    api.post("/api/v1/namespaces/llm/pods", _pod("elsewhere", "2025-01-01T00:00:00Z", f"{a},{b}",
                                                 2, node="other-node"))  # fmt: skip
    api.post("/api/v1/namespaces/llm/pods", _pod("single", "2025-06-01T00:00:00Z", a, 1))
    pods = NodePods(api_client(api), NODE)
    pods.start()
    try:
        wait_until(lambda: len(pods.known()) == 3, what="the pending pods of this node")
        everything = frozenset({a, b, c, d})
        assert pods.claim(2, everything, frozenset({c})) == (c, d)  # must-include decides
        assert pods.claim(2, everything, frozenset()) == (a, b)  # then the oldest
        assert pods.claim(2, everything, frozenset()) is None  # each plan handed out once
        assert pods.claim(1, frozenset({b, c}), frozenset()) is None  # its GPU has no slot
        api.patch("/api/v1/namespaces/llm/pods/single/status", {"status": {"phase": "Running"}})
        wait_until(lambda: len(pods.known()) == 2, what="the running pod to drop out")
    finally:
        pods.stop()


def test_allocation_prefers_the_gpus_the_operator_planned(api: Emulator, short_tmp: Path) -> None:
    kubeconfig = short_tmp / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": api.url}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))  # fmt: skip
    kubelet = StandInKubelet(short_tmp / "dp")
    kubelet.start()
    agent = NodeAgent(
        AgentConfig.for_broker(
            NODE,
            short_tmp / "run" / "broker.sock",
            admin_dir=short_tmp / "admin",
            fake_gpus="2x16Gi",
            device_plugin_dir=short_tmp / "dp",
            metrics_host="127.0.0.1",
            metrics_port=0,
            kubeconfig=str(kubeconfig),
            publish_interval_s=0.2,
        )
    )
    agent.start()
    try:
        assert kubelet.wait_registered(names.RESOURCE_GPU)
        available = sorted(kubelet.devices(names.RESOURCE_GPU))
        # Without a plan, placement takes the emptiest GPU, in index order: GPU 0.
        assert kubelet.preferred(names.RESOURCE_GPU, available, [], 1)[0].startswith(GPUS[0].uuid)
        api.post("/api/v1/namespaces/llm/pods",
                 _pod("planned", "2026-01-01T00:00:00Z", GPUS[1].uuid, 1))  # fmt: skip
        wait_until(
            lambda: kubelet.preferred(names.RESOURCE_GPU, available, [], 1)[0].startswith(
                GPUS[1].uuid
            ),
            what="the planned GPU to be preferred",
        )
        # The agent publishes its KVShareNode too.
        wait_until(lambda: _exists(api, kvsharenode_path()), what="the KVShareNode")
    finally:
        agent.stop()
        kubelet.stop()


def _exists(api: Emulator, path: str) -> bool:
    try:
        api.get(path)
    except urllib.error.HTTPError:
        return False
    return True


def test_every_request_the_agent_makes_is_covered_by_its_rbac(api: Emulator) -> None:
    api.post("/api/v1/nodes", {"metadata": {"name": NODE, "uid": "node-uid-1"}})
    books = books_with_a_pool()
    publisher = KVShareNodePublisher(
        api_client(api), NODE, lambda: status_from_view(books.view(0), "host", 8), NodeMetrics()
    )
    publisher.publish(now=0.0)
    api.delete(kvsharenode_path())
    books.report(1, Report(mapped=GIB, used=GIB, cached=0, reserved=0), 1.0)
    publisher.publish(now=1.0)
    pods = NodePods(api_client(api), NODE)
    pods.start()
    time.sleep(1.0)
    pods.stop()
    seen = agent_calls(api)
    assert seen, "the agent made no requests"
    assert seen <= rbac_allowed(), f"not covered by RBAC_RULES: {seen - rbac_allowed()}"
    assert ("", "pods", "watch") in seen and (names.GROUP, "kvsharenodes", "create") in seen


def rbac_allowed() -> set[tuple[str, str, str]]:
    """(group, resource, verb) the agent's ClusterRole allows."""
    return {
        (group, resource, verb)
        for rule in RBAC_RULES
        for group in rule.api_groups
        for resource in rule.resources
        for verb in rule.verbs
    }


def agent_calls(api: Emulator) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every request the agent (not the test) made."""
    seen = set()
    for request in api.requests():
        if "urllib" in str(request.headers.get("User-Agent")) or request.resource is None:
            continue
        resource = request.resource.plural + (
            f"/{request.subresource}" if request.subresource else ""
        )
        seen.add((request.resource.group, resource, _verb(request)))
    return seen


def _verb(request: Any) -> str:
    """The RBAC verb of a request, as the API server would authorize it."""
    if request.method == kmock.method.PATCH:
        return "patch"
    return {
        kmock.action.FETCH: "get",
        kmock.action.LIST: "list",
        kmock.action.WATCH: "watch",
        kmock.action.CREATE: "create",
        kmock.action.UPDATE: "update",
        kmock.action.DELETE: "delete",
    }[request.action]
