"""The objects the operator creates, rendered from a ModelServer: pure functions.

- :func:`render_pod`: one replica's pod: pinned to its planned node, requesting its GPU
  slots and GPU memory, running the engine's own command line, probed on the engine's
  health endpoint, with the kvshare runtime injected.
- :func:`inject_runtime`: the runtime injection itself (init container copying the
  runtime bundle into a shared volume, ``PYTHONPATH`` for the ``sitecustomize`` hook,
  ``KVSHARE_ENABLE`` and the pod's identity). The admission webhook uses the same
  function for user-made pods.
- :func:`render_service`: the ModelServer's Service, selecting its ready pods.
- :func:`template_hash`: what decides that a replica runs an outdated spec.

Pinning uses a required node affinity on ``metadata.name`` rather than ``spec.nodeName``:
the scheduler still binds the pod, so it accounts ``kvshare.io/gpu`` and
``kvshare.io/gpu-memory`` with every other pod on the node, honours taints, and leaves a
pod that no longer fits Pending (and retried) instead of letting the kubelet reject it
as Failed, which is what a pod bound with ``nodeName`` gets when its resources ran out.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvshare.api import env, kvpolicy, names
from kvshare.api.engines import find_line
from kvshare.api.modelserver import ENGINE_COMMAND_LINES, ModelServerSpec
from kvshare.api.placement import Placement
from kvshare.operator.plan import pod_name
from kvshare.operator.views import ModelServerRef

__all__ = [
    "ENGINE_CONTAINER",
    "RUNTIME_INIT_CONTAINER",
    "RUNTIME_VOLUME",
    "RuntimeImage",
    "endpoint",
    "inject_runtime",
    "pod_selector",
    "render_pod",
    "render_service",
    "runtime_targets",
    "selector_string",
    "template_hash",
]

#: Name of the engine container in replica pods.
ENGINE_CONTAINER = "engine"
#: Name of the init container that copies the runtime bundle.
RUNTIME_INIT_CONTAINER = "kvshare-runtime"
#: Name of the volume holding the copied runtime bundle.
RUNTIME_VOLUME = "kvshare-runtime"
#: Name of the memory-backed /dev/shm volume (tensor-parallel workers share memory there).
SHM_VOLUME = "dshm"
HTTP_PORT_NAME = "http"
HEALTH_PATH = "/health"
#: Spec fields that never replace a running replica: those that only steer placement, and
#: the KV policy, which reaches running replicas in place (see :mod:`.inplace`).
_NOT_IN_TEMPLATE = frozenset(
    {"replicas", "nodeSelector", "colocateWith", "avoidColocationWith", "placementPolicy"}
    | {"kvCache"}
)
# Copies the bundle with the image's own Python: no shell or coreutils needed.
_COPY_BUNDLE = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True)"


@dataclass(frozen=True)
class RuntimeImage:
    """The kvshare image whose runtime bundle is injected, and how to pull it."""

    image: str
    pull_policy: str = "IfNotPresent"


def template_hash(spec: ModelServerSpec) -> str:
    """A short hash of everything in ``spec`` that shapes a replica's pod.

    Placement-only fields are left out (running replicas are never moved), and so is the
    KV policy (changed in place; a pod whose GPU-memory request no longer covers a raised
    ``kvCache.min`` is replaced by the planner), and so are fields left at their
    defaults, so that a kvshare upgrade that adds a field does not replace every replica.
    """
    shaping = {
        key: value
        for key, value in spec.model_dump(by_alias=True, exclude_defaults=True, mode="json").items()
        if key not in _NOT_IN_TEMPLATE
    }
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()
    return digest[:10]


def endpoint(ms: ModelServerRef, spec: ModelServerSpec) -> str:
    """The URL of the ModelServer's Service inside the cluster."""
    return f"http://{ms.name}.{ms.namespace}.svc:{spec.port}"


def pod_selector(ms: ModelServerRef) -> dict[str, str]:
    """Labels that select the ModelServer's replica pods: its Service's selector, and
    (as ``status.selector``) the scale subresource's for autoscalers."""
    return {names.LABEL_MODELSERVER: ms.name, names.LABEL_MANAGED_BY: names.MANAGED_BY}


def selector_string(labels: Mapping[str, str]) -> str:
    """``labels`` as a label selector string (``a=b,c=d``)."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def owner_reference(ms: ModelServerRef) -> dict[str, Any]:
    """The controller owner reference every object made for ``ms`` carries."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.MODELSERVER_KIND,
        "name": ms.name,
        "uid": ms.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def runtime_targets(pod: Mapping[str, Any]) -> list[str]:
    """Containers of ``pod`` that run on kvshare GPUs (request ``kvshare.io/gpu``)."""
    targets = []
    for container in pod.get("spec", {}).get("containers") or ():
        resources = container.get("resources") or {}
        if any(names.RESOURCE_GPU in (resources.get(k) or {}) for k in ("requests", "limits")):
            targets.append(container["name"])
    return targets


def inject_runtime(
    pod: Mapping[str, Any], runtime: RuntimeImage, containers: Collection[str]
) -> dict[str, Any]:
    """``pod`` with the kvshare runtime injected into ``containers``; idempotent.

    Adds the init container that copies the bundle from the kvshare image into a shared
    emptyDir, mounts it read-only into each target container, puts it first on
    ``PYTHONPATH`` (keeping a literal ``PYTHONPATH`` the container already sets) so
    Python runs its ``sitecustomize``, and sets ``KVSHARE_ENABLE=1`` and the pod's
    identity from the downward API. Policy variables already set are kept.
    """
    result = copy.deepcopy(dict(pod))
    spec = result.setdefault("spec", {})
    init = spec.setdefault("initContainers", [])
    if any(c.get("name") == RUNTIME_INIT_CONTAINER for c in init):
        return result
    init.insert(
        0,
        {
            "name": RUNTIME_INIT_CONTAINER,
            "image": runtime.image,
            "imagePullPolicy": runtime.pull_policy,
            "command": [
                "python3",
                "-c",
                _COPY_BUNDLE,
                names.RUNTIME_BUNDLE_DIR,
                names.RUNTIME_MOUNT_DIR,
            ],
            "volumeMounts": [{"name": RUNTIME_VOLUME, "mountPath": names.RUNTIME_MOUNT_DIR}],
            "resources": {
                "requests": {"cpu": "10m", "memory": "64Mi"},
                "limits": {"memory": "256Mi"},
            },
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
        },
    )
    spec.setdefault("volumes", []).append(
        {"name": RUNTIME_VOLUME, "emptyDir": {"sizeLimit": "1Gi"}}
    )
    for container in spec.get("containers") or ():
        if container.get("name") not in containers:
            continue
        container.setdefault("volumeMounts", []).append(
            {"name": RUNTIME_VOLUME, "mountPath": names.RUNTIME_MOUNT_DIR, "readOnly": True}
        )
        container["env"] = _runtime_env(container.get("env") or [])
    return result


def _runtime_env(existing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    set_names = {item.get("name") for item in existing}
    python_path = names.RUNTIME_MOUNT_DIR
    kept = []
    for item in existing:
        if item.get("name") == "PYTHONPATH" and item.get("value"):
            python_path = f"{names.RUNTIME_MOUNT_DIR}:{item['value']}"
        elif item.get("name") not in ("PYTHONPATH", env.ENABLE.name):
            kept.append(item)
    added = [
        {"name": env.ENABLE.name, "value": "1"},
        {"name": "PYTHONPATH", "value": python_path},
    ]
    identity = (
        (env.POD_NAMESPACE.name, "metadata.namespace"),
        (env.POD_NAME.name, "metadata.name"),
        (env.POD_UID.name, "metadata.uid"),
    )
    added += [_field_env(name, path) for name, path in identity if name not in set_names]
    return kept + added


def _engine_container(
    spec: ModelServerSpec, ms: ModelServerRef, kv_capacity: int | None
) -> dict[str, Any]:
    line = find_line(spec.engine, spec.engine_version_resolved())
    command = ENGINE_COMMAND_LINES[spec.engine].argv(
        model=spec.model,
        port=spec.port,
        tensor_parallel_size=spec.tensor_parallel_size,
        extra=(*line.memory_flags, *spec.engine_args),
    )
    policy = [
        {"name": env.MODELSERVER.name, "value": ms.name},
        {"name": env.STATIC_BYTES.name, "value": str(spec.static_bytes_per_worker())},
        {"name": env.KV_MIN.name, "value": str(spec.kv_cache.min)},
        {"name": env.KV_PRIORITY.name, "value": str(spec.kv_cache.priority)},
    ]
    if spec.kv_cache.max is not None:
        policy.append({"name": env.KV_MAX.name, "value": str(spec.kv_cache.max)})
    if kv_capacity is not None:
        # The pool's virtual size: what kvCache.max may be raised to without a restart.
        policy.append({"name": env.KV_CAPACITY.name, "value": str(kv_capacity)})
    gpu = {
        names.RESOURCE_GPU: str(spec.tensor_parallel_size),
        names.RESOURCE_GPU_MEMORY: str(spec.gpu_memory_units_per_replica()),
    }
    resources = spec.resources.to_wire()
    probe = {"httpGet": {"path": HEALTH_PATH, "port": HTTP_PORT_NAME}}
    return {
        "name": ENGINE_CONTAINER,
        "image": spec.image,
        "command": command,
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        # The user's variables first: for a repeated name the last entry wins, and the
        # policy kvshare derives from the spec must not be overridden by accident.
        "env": [item.to_wire() for item in spec.env] + policy,
        "resources": {
            "requests": {**resources.get("requests", {}), **gpu},
            "limits": {**resources.get("limits", {}), **gpu},
        },
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
        # Loading weights can take long: the startup probe allows an hour before the
        # liveness probe takes over.
        "startupProbe": {
            **probe,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 360,
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **probe,
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
    }


def render_pod(
    ms: ModelServerRef,
    spec: ModelServerSpec,
    *,
    replica: int,
    placement: Placement,
    template: str,
    runtime: RuntimeImage,
    kv_capacity: int | None = None,
) -> dict[str, Any]:
    """Replica ``replica``'s pod, pinned to ``placement``, labelled with hash ``template``;
    ``kv_capacity``: the most KV cache per worker its GPUs could ever lend it."""
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(ms.name, replica),
            "namespace": ms.namespace,
            # The spec's own labels and annotations never use kvshare's keys (validated),
            # so the order only documents which ones the operator relies on.
            "labels": {
                **spec.pod_labels,
                names.LABEL_MODELSERVER: ms.name,
                names.LABEL_REPLICA: str(replica),
                names.LABEL_TEMPLATE_HASH: template,
                names.LABEL_MANAGED_BY: names.MANAGED_BY,
            },
            "annotations": {
                **spec.pod_annotations,
                names.ANNOTATION_NODE: placement.node,
                names.ANNOTATION_GPUS: ",".join(placement.gpus),
                names.ANNOTATION_KV_POLICY: kvpolicy.encode(spec.kv_cache),
            },
            "ownerReferences": [owner_reference(ms)],
        },
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": [placement.node],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [t.to_wire() for t in spec.tolerations],
            # Service links would put e.g. VLLM_PORT=tcp://... into the environment of a
            # pod next to a Service named "vllm", which the engine reads as its own setting.
            "enableServiceLinks": False,
            "restartPolicy": "Always",
            "containers": [_engine_container(spec, ms, kv_capacity)],
            "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
        },
    }
    if spec.image_pull_secrets:
        # Pod-wide: they serve the runtime's init container (the kvshare image) too.
        pod["spec"]["imagePullSecrets"] = [ref.to_wire() for ref in spec.image_pull_secrets]
    if spec.service_account_name is not None:
        pod["spec"]["serviceAccountName"] = spec.service_account_name
    return inject_runtime(pod, runtime, [ENGINE_CONTAINER])


def render_service(ms: ModelServerRef, spec: ModelServerSpec) -> dict[str, Any]:
    """The ModelServer's Service: its name, the engine port, the ready replica pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": ms.name,
            "namespace": ms.namespace,
            "labels": {names.LABEL_MODELSERVER: ms.name, names.LABEL_MANAGED_BY: names.MANAGED_BY},
            "ownerReferences": [owner_reference(ms)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": pod_selector(ms),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": spec.port,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }
