"""KV policies changed in place, the cluster's side: a pod's ``kvshare.io/kv-policy``
annotation, read and handed to the broker.

The operator writes a ModelServer's ``kvCache`` into each replica pod's annotation; the
node agent's pod watch hands every pod of this node to :func:`send_to_broker`, which reads
it (:func:`pod_policy`) and gives the broker what it asks; the broker applies it to the
pod's pools (:mod:`kvshare.deviceplugin.broker.overrides`), now and to every pool the pod
opens later.

The annotation is untrusted (anyone who may patch the pod can write it): it is read by
:func:`kvshare.api.kvpolicy.decode` (bounded, strict, the CRD's bounds), and the GPU memory
the pod requested per GPU goes with it, so that the broker can refuse a minimum beyond it.
"""

from __future__ import annotations

from typing import Any

from kvshare.api import kvpolicy, names
from kvshare.api.priorities import PriorityCeilings
from kvshare.deviceplugin.broker.overrides import PodPolicy
from kvshare.deviceplugin.broker.server import Broker

__all__ = ["pod_policy", "send_to_broker"]


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


def _requests(pod: Any) -> tuple[int, int]:
    """The pod's ``kvshare.io/gpu`` and ``kvshare.io/gpu-memory`` requests (0 when none or
    unreadable), summed over its containers."""
    gpus = units = 0
    for container in _get(pod, "spec", "containers") or ():
        requests = _get(container, "resources", "requests") or {}
        try:
            gpus += int(str(requests.get(names.RESOURCE_GPU, 0)))
            units += int(str(requests.get(names.RESOURCE_GPU_MEMORY, 0)))
        except ValueError:
            return 0, 0
    return gpus, units


def pod_policy(pod: Any, ceilings: PriorityCeilings | None = None) -> tuple[str, PodPolicy | None]:
    """The pod's uid and the policy its annotation asks for (``None``: no annotation),
    its priority no higher than ``ceilings`` grant the pod's namespace."""
    uid = str(_get(pod, "metadata", "uid") or "")
    text = (_get(pod, "metadata", "annotations") or {}).get(names.ANNOTATION_KV_POLICY)
    if text is None:
        return uid, None
    try:
        spec = kvpolicy.decode(str(text))
    except kvpolicy.PolicyError as exc:
        return uid, PodPolicy(error=f"annotation {names.ANNOTATION_KV_POLICY} is not valid: {exc}")
    gpus, units = _requests(pod)
    priority = spec.priority
    if ceilings is not None:
        priority = min(priority, ceilings.ceiling(str(_get(pod, "metadata", "namespace") or "")))
    return uid, PodPolicy(
        revision=kvpolicy.revision(spec.min, spec.max, priority),
        kv_min=spec.min,
        kv_max=spec.max,
        priority=priority,
        per_gpu_bytes=units * names.GPU_MEMORY_UNIT_BYTES // gpus if gpus and units else None,
    )


def send_to_broker(
    broker: Broker, kind: str, pod: Any, ceilings: PriorityCeilings | None = None
) -> str:
    """Pod ``pod`` of this node changed (watch event ``kind``): the policy its annotation
    asks for goes to the broker (a deleted pod's pools keep what they run). Returns the
    pod's uid."""
    uid, policy = pod_policy(pod, ceilings)
    broker.set_pod_policy(uid, None if kind == "DELETED" else policy)
    return uid
