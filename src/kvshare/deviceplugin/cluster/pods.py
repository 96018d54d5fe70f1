"""The pods of this node, as the API server has them: who each is (for the broker's check
of a pool's identity) and, for pending ones, the GPUs the operator planned.

The watch is per node (field selector ``spec.nodeName``): the agent keeps every pod of
its node that has not finished (:class:`PodFacts`: namespace, name, its
``kvshare.io/modelserver`` label, its ``kvshare.io/gpu-memory`` request), so that a pool's
connection is bound to a pod the agent knows, with the names of that pod.

``Allocate`` carries no pod identity, but the operator writes each replica's planned
GPUs into its pod (annotation ``kvshare.io/gpus``, rank order) and pins the pod to the
node. This watcher keeps the pending pods of this node in memory (list, then watch) so
``GetPreferredAllocation`` can prefer the planned GPUs of the *oldest* pending pod whose
``kvshare.io/gpu`` request has the asked size, fits the available slots and contains
the must-include slots' GPUs. A pod's plan is handed out once (then held for
``claim_ttl_s``, in case the kubelet does not follow up), so two pods with the same
request size get their own plans. When nothing matches, the caller falls back to
placement.

The same watch feeds other consumers of this node's pods (``on_pod``): the in-place KV
policies of :mod:`kvshare.deviceplugin.cluster.pod_policies`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshare.api import names

__all__ = ["NodePods", "PlannedPod", "PodFacts", "planned_pod", "pod_facts"]

log = logging.getLogger(__name__)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True)
class PlannedPod:
    """A pending pod with planned GPUs."""

    uid: str
    name: str
    created: datetime.datetime
    gpus: tuple[str, ...]
    sizes: frozenset[int]
    """The ``kvshare.io/gpu`` counts its containers request."""


@dataclass(frozen=True)
class PodFacts:
    """A pod of this node that has not finished, as the API server has it."""

    uid: str
    namespace: str
    name: str
    modelserver: str
    """Its ``kvshare.io/modelserver`` label ("" without one)."""
    gpu_memory_bytes: int
    """Its ``kvshare.io/gpu-memory`` request over all containers, in bytes."""


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


def _on_node(pod: Any, node: str) -> bool:
    return node in (_get(pod, "spec", "node_name"), _get(pod, "spec", "nodeName"))


def _gpu_memory_units(pod: Any) -> int:
    """The pod's ``kvshare.io/gpu-memory`` units (requests, else limits: for an extended
    resource they are equal), over its containers; 0 when none or unreadable."""
    units = 0
    for container in _get(pod, "spec", "containers") or ():
        resources = _get(container, "resources") or {}
        for kind in ("requests", "limits"):
            amount = (_get(resources, kind) or {}).get(names.RESOURCE_GPU_MEMORY)
            if amount is not None:
                try:
                    units += max(int(str(amount)), 0)
                except ValueError:
                    return 0
                break
    return units


def pod_facts(pod: Any, node: str) -> PodFacts | None:
    """What the agent knows of ``pod`` (a client object or a dict) if it is a pod of
    ``node`` that has not finished."""
    if not _on_node(pod, node) or _get(pod, "status", "phase") in ("Succeeded", "Failed"):
        return None
    uid = str(_get(pod, "metadata", "uid") or "")
    if not uid:
        return None
    labels = _get(pod, "metadata", "labels") or {}
    return PodFacts(
        uid=uid,
        namespace=str(_get(pod, "metadata", "namespace") or ""),
        name=str(_get(pod, "metadata", "name") or ""),
        modelserver=str(labels.get(names.LABEL_MODELSERVER, "")),
        gpu_memory_bytes=_gpu_memory_units(pod) * names.GPU_MEMORY_UNIT_BYTES,
    )


def planned_pod(pod: Any, node: str) -> PlannedPod | None:
    """The plan of ``pod`` (a client object or a dict) if it is pending on ``node`` with
    planned GPUs and asks for ``kvshare.io/gpu``."""
    if _get(pod, "spec", "node_name") != node and _get(pod, "spec", "nodeName") != node:
        return None
    if _get(pod, "status", "phase") not in (None, "Pending"):
        return None
    annotations = _get(pod, "metadata", "annotations") or {}
    gpus = tuple(u.strip() for u in str(annotations.get(names.ANNOTATION_GPUS, "")).split(","))
    gpus = tuple(u for u in gpus if u)
    if not gpus:
        return None
    sizes = set()
    for container in _get(pod, "spec", "containers") or []:
        resources = _get(container, "resources") or {}
        for kind in ("limits", "requests"):
            amount = (_get(resources, kind) or {}).get(names.RESOURCE_GPU)
            if amount is not None:
                try:
                    sizes.add(int(str(amount)))
                except ValueError:
                    continue
                break
    if not sizes:
        return None
    created = _get(pod, "metadata", "creation_timestamp") or _get(
        pod, "metadata", "creationTimestamp"
    )
    if isinstance(created, str):
        try:
            created = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
        except ValueError:
            created = None
    return PlannedPod(
        uid=str(_get(pod, "metadata", "uid") or _get(pod, "metadata", "name")),
        name=f"{_get(pod, 'metadata', 'namespace')}/{_get(pod, 'metadata', 'name')}",
        created=created if isinstance(created, datetime.datetime) else _EPOCH,
        gpus=gpus,
        sizes=frozenset(sizes),
    )


class NodePods:
    """Watches this node's pods: their facts, and planned GPUs to hand out (see the
    module docstring)."""

    def __init__(
        self,
        api_client: Any,
        node: str,
        claim_ttl_s: float = 120.0,
        on_pod: Callable[[str, Any], None] | None = None,
    ) -> None:
        """``on_pod(event type, pod)`` is called for every event of a pod on ``node``."""
        self._api_client = api_client
        self._node = node
        self._on_pod = on_pod
        self._claim_ttl = claim_ttl_s
        self._lock = threading.Lock()  # guards _pods, _facts, _claimed and _listed
        self._pods: dict[str, PlannedPod] = {}
        self._facts: dict[str, PodFacts] = {}
        self._claimed: dict[str, float] = {}
        self._listed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    def start(self) -> None:
        """List and watch the node's pods on a thread (``kvshare-pods``)."""
        self._thread = threading.Thread(target=self._run, name="kvshare-pods", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def facts(self, uid: str) -> PodFacts | None:
        """The pod with ``uid`` if it is a pod of this node that has not finished."""
        with self._lock:
            return self._facts.get(uid)

    @property
    def listed(self) -> bool:
        """Whether the node's pods have been listed once (before: nothing is known)."""
        with self._lock:
            return self._listed

    def known(self) -> list[PlannedPod]:
        """Pending pods with plans, oldest first."""
        with self._lock:
            return sorted(self._pods.values(), key=lambda p: (p.created, p.uid))

    def claim(
        self, size: int, usable: frozenset[str], must: frozenset[str]
    ) -> tuple[str, ...] | None:
        """The planned GPUs of the oldest unclaimed pending pod that fits, now claimed."""
        now = time.monotonic()
        with self._lock:
            for pod in sorted(self._pods.values(), key=lambda p: (p.created, p.uid)):
                claimed_at = self._claimed.get(pod.uid)
                if claimed_at is not None and now - claimed_at < self._claim_ttl:
                    continue
                if size not in pod.sizes or len(pod.gpus) != size:
                    continue
                if not must <= set(pod.gpus) or not set(pod.gpus) <= usable:
                    continue
                self._claimed[pod.uid] = now
                log.info("preferring the planned GPUs of pending pod %s", pod.name)
                return pod.gpus
        return None

    def _update(self, kind: str, pod: Any) -> None:
        if self._on_pod is not None and _on_node(pod, self._node):
            try:
                self._on_pod(kind, pod)
            except Exception:  # one consumer's bug must not stop the watch
                log.exception("handling pod %s failed", _get(pod, "metadata", "name"))
        uid = str(_get(pod, "metadata", "uid") or _get(pod, "metadata", "name"))
        plan = planned_pod(pod, self._node) if kind != "DELETED" else None
        facts = pod_facts(pod, self._node) if kind != "DELETED" else None
        with self._lock:
            if plan is None:
                self._pods.pop(uid, None)
                self._claimed.pop(uid, None)
            else:
                self._pods[uid] = plan
            if facts is None:
                self._facts.pop(uid, None)
            else:
                self._facts[uid] = facts

    def _run(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self._api_client)
        selector = f"spec.nodeName={self._node}"
        backoff = 1.0
        while not self._stop.is_set():
            try:
                listing = core.list_pod_for_all_namespaces(field_selector=selector)
                with self._lock:
                    self._pods.clear()
                    self._facts.clear()
                for pod in listing.items:
                    self._update("ADDED", pod)
                with self._lock:
                    self._listed = True
                version = listing.metadata.resource_version if listing.metadata else None
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=version,
                    timeout_seconds=300,
                ):
                    self._update(str(event["type"]), event["object"])
                    if self._stop.is_set():
                        break
                backoff = 1.0
            except Exception as exc:  # the API being away must never stop the agent
                if self._stop.is_set():
                    return
                log.warning("watching pods on %s failed (%s); retrying", self._node, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
