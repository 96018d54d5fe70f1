"""What the operator needs to know about the objects it watches, read from their bodies.

The kopf indexes keep these small immutable views instead of whole objects: a
:class:`PodView` per replica pod, a :class:`NodeView` per Node, a :class:`GpuNodeView` per
KVShareNode, and a :class:`ModelServerRef` with the raw spec and status per ModelServer.
Parsing happens once per watch event; planning reads only views.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvshare.api import env, kvpolicy, names
from kvshare.api.kube import SpecError, validate
from kvshare.api.kvsharenode import KVShareNodeStatus
from kvshare.api.placement import Taint
from kvshare.api.quantity import QuantityError, parse_bytes

__all__ = [
    "GpuNodeView",
    "ModelServerKey",
    "ModelServerRef",
    "NodeView",
    "PodView",
    "node_view",
    "pod_view",
]

log = logging.getLogger(__name__)

#: (namespace, name) of a ModelServer.
ModelServerKey = tuple[str, str]


@dataclass(frozen=True)
class ModelServerRef:
    """A ModelServer as last seen: identity, generation, and its raw spec and status."""

    namespace: str
    name: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    deleting: bool = False

    @property
    def key(self) -> ModelServerKey:
        return (self.namespace, self.name)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ModelServerRef:
        meta = body.get("metadata", {})
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            generation=int(meta.get("generation") or 0),
            spec=copy.deepcopy(dict(body.get("spec") or {})),
            status=copy.deepcopy(dict(body.get("status") or {})),
            deleting=bool(meta.get("deletionTimestamp")),
        )

    def body(self) -> dict[str, Any]:
        """A minimal body for object references (events, owner references)."""
        return {
            "apiVersion": names.API_VERSION,
            "kind": names.MODELSERVER_KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }


@dataclass(frozen=True)
class PodView:
    """One replica pod the operator made, as the API server last reported it."""

    namespace: str
    name: str
    uid: str
    modelserver: str
    replica: int
    template_hash: str
    node: str
    """The node the pod was planned onto (and is pinned to)."""
    gpus: tuple[str, ...]
    """Planned GPU UUIDs, in rank order."""
    per_gpu_bytes: int
    """Static footprint plus KV minimum per worker, as the pod itself declares it (the
    minimum of its KV-policy annotation, which may have changed in place)."""
    kv_policy: str = ""
    """The pod's ``kvshare.io/kv-policy`` annotation (its KV policy, changed in place)."""
    gpu_memory_units: int = 0
    """The pod's ``kvshare.io/gpu-memory`` request (fixed for the pod's lifetime)."""
    phase: str = "Pending"
    ready: bool = False
    terminating: bool = False
    message: str = ""
    """Why the pod failed or is not ready, when the kubelet says."""
    failure: str = ""
    """Why a finished pod stopped: the pod's reason and message (e.g. an eviction, or GPUs
    refused at admission), else its last container termination."""
    crash_looping: str = ""
    """Set while the kubelet holds back a container that keeps exiting (CrashLoopBackOff):
    the container and its last termination."""

    @property
    def key(self) -> ModelServerKey:
        return (self.namespace, self.modelserver)

    @property
    def finished(self) -> bool:
        """The pod's containers will not run again (Failed or Succeeded)."""
        return self.phase in ("Failed", "Succeeded")


def _env_bytes(container: Mapping[str, Any], name: str) -> int:
    for item in container.get("env") or ():
        if item.get("name") == name and "value" in item:
            return parse_bytes(str(item["value"]), field=name)
    return 0


def pod_view(body: Mapping[str, Any]) -> PodView | None:
    """The view of a replica pod, or ``None`` for a pod that is not one (logged)."""
    meta = body.get("metadata", {})
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    name = meta.get("name", "")
    try:
        replica = int(labels[names.LABEL_REPLICA])
        modelserver = labels[names.LABEL_MODELSERVER]
        node = annotations[names.ANNOTATION_NODE]
    except (KeyError, ValueError):
        log.warning(
            "pod %s/%s is labelled as kvshare's but lacks its replica labels; ignored",
            meta.get("namespace"),
            name,
        )
        return None
    engine: Mapping[str, Any] = next(
        (
            c
            for c in body.get("spec", {}).get("containers") or ()
            if any(e.get("name") == env.STATIC_BYTES.name for e in c.get("env") or ())
        ),
        {},
    )
    policy = str(annotations.get(names.ANNOTATION_KV_POLICY, ""))
    try:
        kv_min = _env_bytes(engine, env.KV_MIN.name)
        with contextlib.suppress(kvpolicy.PolicyError):
            kv_min = kvpolicy.decode(policy).min if policy else kv_min
        per_gpu = _env_bytes(engine, env.STATIC_BYTES.name) + kv_min
    except QuantityError as exc:
        log.warning(
            "pod %s/%s declares unreadable memory (%s); counted as 0",
            meta.get("namespace"),
            name,
            exc,
        )
        per_gpu = 0
    status = body.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    gpus = tuple(g for g in str(annotations.get(names.ANNOTATION_GPUS, "")).split(",") if g)
    return PodView(
        namespace=meta.get("namespace", ""),
        name=name,
        uid=meta.get("uid", ""),
        modelserver=modelserver,
        replica=replica,
        template_hash=labels.get(names.LABEL_TEMPLATE_HASH, ""),
        node=node,
        gpus=gpus,
        per_gpu_bytes=per_gpu,
        kv_policy=policy,
        gpu_memory_units=_gpu_memory_units(engine),
        phase=status.get("phase") or "Pending",
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        message=_pod_message(status),
        failure=_pod_failure(status),
        crash_looping=_crash_loop(status),
    )


def _gpu_memory_units(container: Mapping[str, Any]) -> int:
    requests = (container.get("resources") or {}).get("requests") or {}
    try:
        return int(str(requests.get(names.RESOURCE_GPU_MEMORY, 0)))
    except ValueError:
        return 0


#: Longest piece of a kubelet message (a container's termination log can be 4 KiB) kept.
_MAX_DETAIL = 300
#: Container waiting reasons that are the normal way to start, not worth reporting.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def _container_statuses(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]


def _termination(container: Mapping[str, Any]) -> str:
    """A container's current or last termination: ``engine: OOMKilled, exit code 137``."""
    for state in (container.get("state") or {}, container.get("lastState") or {}):
        ended = state.get("terminated")
        if ended:
            what = f"{ended.get('reason') or 'exited'}, exit code {ended.get('exitCode', '?')}"
            detail = f": {ended['message']}" if ended.get("message") else ""
            return _clip(f"container {container.get('name', '?')}: {what}{detail}")
    return ""


def _pod_reason(status: Mapping[str, Any]) -> str:
    reason, message = status.get("reason"), status.get("message")
    return _clip(": ".join(filter(None, (reason, message))))


def _pod_message(status: Mapping[str, Any]) -> str:
    """Why a pod is not running, as the scheduler or the kubelet put it."""
    for condition in status.get("conditions") or ():
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "")
    if status.get("reason") or status.get("message"):
        return _pod_reason(status)
    for container in _container_statuses(status):
        waiting = (container.get("state") or {}).get("waiting") or {}
        # CrashLoopBackOff's message changes with every back-off; crash_looping says it.
        if waiting.get("reason") and waiting["reason"] not in {*_STARTING, "CrashLoopBackOff"}:
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            return _clip(f"container {container.get('name', '?')}: {waiting['reason']}{detail}")
    return ""


def _pod_failure(status: Mapping[str, Any]) -> str:
    """Why a finished pod stopped (empty for a pod that has not)."""
    if status.get("phase") not in ("Failed", "Succeeded"):
        return ""
    return _pod_reason(status) or next(
        (t for t in map(_termination, _container_statuses(status)) if t), ""
    )


def _crash_loop(status: Mapping[str, Any]) -> str:
    """The first container held back after exiting again and again, and why it exited."""
    for container in _container_statuses(status):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            return _termination(container) or f"container {container.get('name', '?')}"
    return ""


@dataclass(frozen=True)
class NodeView:
    """A Node's scheduling facts: labels, taints, and whether it is cordoned."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]
    schedulable: bool


def node_view(body: Mapping[str, Any]) -> NodeView:
    """The scheduling view of a Node object."""
    meta = body.get("metadata", {})
    spec = body.get("spec") or {}
    taints = tuple(
        Taint(key=t.get("key", ""), value=t.get("value") or "", effect=t.get("effect", ""))
        for t in spec.get("taints") or ()
    )
    return NodeView(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        taints=taints,
        schedulable=not spec.get("unschedulable", False),
    )


@dataclass(frozen=True)
class GpuNodeView:
    """A KVShareNode: the node agent's GPUs and the pools on them."""

    node: str
    status: KVShareNodeStatus

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> GpuNodeView | None:
        """The view, or ``None`` (logged) when the status does not parse."""
        meta = body.get("metadata", {})
        node = (body.get("spec") or {}).get("nodeName") or meta.get("name", "")
        try:
            status = validate(KVShareNodeStatus, body.get("status") or {}, kind="KVShareNode")
        except SpecError as exc:
            log.warning("KVShareNode %s is ignored: %s", meta.get("name"), exc)
            return None
        return cls(node=node, status=status)
