"""What the node agent does to a pod of its node when its lease is overused
(:mod:`kvshare.deviceplugin.broker.enforcement`): a Warning Event on the pod, and, when it
keeps on, an eviction through the Eviction API (which honours PodDisruptionBudgets).

Both are best effort: a failure is logged, the broker's reclaim stands either way.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

__all__ = ["PodRef", "evict_pod", "post_pod_event"]

log = logging.getLogger(__name__)

_COMPONENT = "kvshare-node-agent"
_TIMEOUT = (5.0, 10.0)


class PodRef:
    """The pod an action is about."""

    __slots__ = ("name", "namespace", "uid")

    def __init__(self, namespace: str, name: str, uid: str) -> None:
        self.namespace = namespace
        self.name = name
        self.uid = uid


def post_pod_event(api_client: Any, pod: PodRef, node: str, reason: str, message: str) -> None:
    """A Warning Event about ``pod`` (``kubectl describe pod`` shows it)."""
    from kubernetes import client

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body: Any = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod.name}.{time.time_ns():x}", "namespace": pod.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning",
        "source": {"component": _COMPONENT, "host": node},
        "reportingComponent": _COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        client.CoreV1Api(api_client).create_namespaced_event(
            pod.namespace, body, _request_timeout=_TIMEOUT
        )
    except Exception as exc:  # an Event is best effort
        log.warning(
            "cannot post Event %s about pod %s/%s: %s", reason, pod.namespace, pod.name, exc
        )


def evict_pod(api_client: Any, pod: PodRef) -> bool:
    """Evict ``pod`` (the Eviction API); whether the API server took the eviction."""
    from kubernetes import client

    body: Any = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
        # Only the pod that overused: not a newer pod of the same name.
        "deleteOptions": {"preconditions": {"uid": pod.uid}},
    }
    try:
        client.CoreV1Api(api_client).create_namespaced_pod_eviction(
            pod.name, pod.namespace, body, _request_timeout=_TIMEOUT
        )
    except Exception as exc:  # e.g. a PodDisruptionBudget refuses it now: tried again later
        log.warning("cannot evict pod %s/%s: %s", pod.namespace, pod.name, exc)
        return False
    return True
