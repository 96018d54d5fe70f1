"""The KVShareNode publisher: this node's GPUs and pools, written to the cluster.

One cluster-scoped ``KVShareNode`` named after the node (owned by the Node object, so it
goes when the node goes). The publisher creates it when missing and patches its status
at a bounded rate: it looks at the books every ``interval_s`` and writes only when
something changed, or every ``heartbeat_s`` so readers can tell a live agent from a
stale object. Changes between two looks are coalesced into one write.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare import __version__
from kvshare.api import names
from kvshare.api.kube import Condition
from kvshare.api.kvsharenode import GpuStatus, KVShareNodeSpec, KVShareNodeStatus, PoolStatus
from kvshare.deviceplugin.admin.metrics import NodeMetrics
from kvshare.deviceplugin.broker.overrides import PolicyState
from kvshare.deviceplugin.broker.views import BooksView, PoolView

__all__ = ["RBAC_RULES", "KVShareNodePublisher", "PolicyRule", "status_from_view"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyRule:
    """One rule of a ClusterRole."""

    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def to_dict(self) -> dict[str, list[str]]:
        """The rule as a ClusterRole lists it."""
        return {
            "apiGroups": list(self.api_groups),
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }


#: Everything the node agent asks of the Kubernetes API (a ClusterRole: KVShareNodes
#: are cluster-scoped and the node's pods live in every namespace). RBAC cannot narrow
#: these to one node; the agent asks for its own node's objects only (the pod watch's
#: field selector, the KVShareNode named after the node), and the chart's admission
#: policy holds each agent's KVShareNode writes to its own node.
RBAC_RULES: tuple[PolicyRule, ...] = (
    # Create this node's KVShareNode when missing; read it back.
    PolicyRule((names.GROUP,), (names.KVSHARENODE_PLURAL,), ("get", "create")),
    # Write its status.
    PolicyRule((names.GROUP,), (f"{names.KVSHARENODE_PLURAL}/status",), ("get", "patch")),
    # The Node: its uid (the KVShareNode's owner), labels (the configuration to run) and
    # allocatable (another device plugin serving the same GPUs).
    PolicyRule(("",), ("nodes",), ("get",)),
    # The pods of this node (spec.nodeName): who a pool's process is, and the planned GPUs
    # of pending ones (preferred allocations).
    PolicyRule(("",), ("pods",), ("list", "watch")),
    # Evict a pod that keeps holding more device memory than its lease.
    PolicyRule(("",), ("pods/eviction",), ("create",)),
    # Warnings about the Node (another device plugin hands out its GPUs, an unknown
    # configuration named by its label) and about pods that overuse their lease.
    PolicyRule(("",), ("events",), ("create",)),
)


def _pool_status(pool: PoolView, policy: PolicyState | None) -> PoolStatus:
    return PoolStatus(
        namespace=pool.namespace[:63],
        pod=(pool.pod or pool.name)[:253],
        modelserver=pool.modelserver or None,
        rank=pool.rank,
        tp_size=pool.tp_size,
        engine=pool.engine[:32] or None,
        priority=pool.priority,
        static=pool.static,
        kv_min=pool.kv_min,
        kv_max=pool.kv_max,
        lease=pool.lease,
        want=pool.want,
        mapped=pool.mapped,
        used=pool.used,
        over_lease=pool.over_lease,
        policy=policy.policy if policy else "",
        policy_refused=policy.refused if policy else "",
        policy_message=policy.message[:512] if policy else "",
    )


def status_from_view(
    view: BooksView,
    backend: str,
    slots_per_gpu: int,
    observed_at: str | None = None,
    *,
    node_config: str | None = None,
    conditions: Sequence[Condition] = (),
    policies: Mapping[int, PolicyState] | None = None,
) -> KVShareNodeStatus:
    """The KVShareNode status for the books in ``view``.

    ``slotsUsed`` counts the distinct workers (pod, or process outside Kubernetes) with a
    pool on the GPU.
    """
    gpus = []
    for gpu in view.gpus:
        pools = [p for p in view.pools if p.gpu == gpu.uuid]
        workers = {(p.pod_uid or p.pod or f"pid-{p.pid}", p.rank) for p in pools}
        gpus.append(
            GpuStatus(
                uuid=gpu.uuid,
                index=gpu.index,
                name=gpu.name[:128],
                healthy=gpu.healthy,
                draining=gpu.draining,
                total=gpu.total,
                headroom=gpu.headroom,
                static=gpu.static,
                kv_min=gpu.kv_min,
                kv_lease=gpu.kv_lease,
                kv_mapped=gpu.kv_mapped,
                kv_used=gpu.kv_used,
                free=max(gpu.free, 0),
                slots=slots_per_gpu,
                slots_used=min(len(workers), slots_per_gpu),
                pools=[_pool_status(p, (policies or {}).get(p.id)) for p in pools[:256]],
            )
        )
    return KVShareNodeStatus(
        backend="host" if backend == "host" else "cuda",
        agent_version=__version__,
        observed_at=observed_at,
        gpu_count=len(gpus),
        pool_count=len(view.pools),
        free=sum(g.free for g in gpus),
        gpus=gpus,
        node_config=node_config,
        conditions=list(conditions),
    )


class KVShareNodePublisher:
    """Keeps ``KVShareNode/<node>`` in step with the books (see the module docstring)."""

    def __init__(
        self,
        api_client: Any,
        node: str,
        status: Callable[[], KVShareNodeStatus],
        metrics: NodeMetrics,
        *,
        interval_s: float = 10.0,
        heartbeat_s: float = 60.0,
    ) -> None:
        from kubernetes import client

        self._objects = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._exception = client.ApiException
        self.node = node
        self._status = status
        self._metrics = metrics
        self._interval = interval_s
        self._heartbeat = heartbeat_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exists = False
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0

    def start(self) -> None:
        """Publish on a thread (``kvshare-publisher``) until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="kvshare-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def publish(self, now: float) -> bool:
        """Write the status if it changed or the heartbeat is due; True when written."""
        status = self._status()
        content = status.to_wire()
        content.pop("observedAt", None)
        if content == self._last and now - self._last_at < self._heartbeat:
            return False
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {**status.to_wire(), "observedAt": stamp}}
        if not self._exists:
            self._ensure_exists()
        try:
            self._patch(body)
        except self._exception as exc:
            if exc.status != 404:
                raise
            self._exists = False  # deleted behind our back: create it again
            self._ensure_exists()
            self._patch(body)
        self._last, self._last_at = content, now
        self._metrics.kvsharenode_writes.labels("ok").inc()
        return True

    def _patch(self, body: dict[str, Any]) -> None:
        self._objects.patch_cluster_custom_object_status(
            names.GROUP, names.VERSION, names.KVSHARENODE_PLURAL, self.node, body
        )

    def _ensure_exists(self) -> None:
        try:
            self._objects.get_cluster_custom_object(
                names.GROUP, names.VERSION, names.KVSHARENODE_PLURAL, self.node
            )
        except self._exception as exc:
            if exc.status != 404:
                raise
            self._create()
        self._exists = True

    def _create(self) -> None:
        metadata: dict[str, Any] = {"name": self.node}
        try:
            node = self._core.read_node(self.node)
            uid = node.metadata.uid if node.metadata else None
            if uid:
                metadata["ownerReferences"] = [
                    {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid}
                ]
        except self._exception as exc:
            log.info(
                "KVShareNode %s without an owner (Node not readable: %s)", self.node, exc.status
            )
        body = {
            "apiVersion": names.API_VERSION,
            "kind": names.KVSHARENODE_KIND,
            "metadata": metadata,
            "spec": KVShareNodeSpec(node_name=self.node).to_wire(),
        }
        try:
            self._objects.create_cluster_custom_object(
                names.GROUP, names.VERSION, names.KVSHARENODE_PLURAL, body
            )
            log.info("created KVShareNode %s", self.node)
        except self._exception as exc:
            if exc.status != 409:  # created meanwhile by a previous agent: fine
                raise

    def _run(self) -> None:
        import time

        backoff = self._interval
        while not self._stop.is_set():
            try:
                self.publish(time.monotonic())
                backoff = self._interval
            except Exception as exc:  # the API being away must never stop the agent
                self._metrics.kvsharenode_writes.labels("failed").inc()
                log.warning("writing KVShareNode %s failed (%s); retrying", self.node, exc)
                self._exists = False
                backoff = min(backoff * 2, 300.0)
            self._stop.wait(backoff)
