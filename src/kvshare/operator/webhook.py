"""Runtime injection into user-made pods, for the admission webhook (off by default).

Pods labelled ``kvshare.io/inject: "true"`` get the same injection as the operator's own
replica pods (:func:`kvshare.operator.render.inject_runtime`) in every container that
requests ``kvshare.io/gpu``. Their KV policy is theirs to set (``KVSHARE_KV_MIN`` and
friends in the container's env); the webhook adds only the runtime and the identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvshare.api import names
from kvshare.operator.render import RuntimeImage, inject_runtime, runtime_targets

__all__ = ["Injection", "injection_for"]

#: The parts of a pod's spec the injection changes.
INJECTED_FIELDS = ("initContainers", "containers", "volumes")


@dataclass(frozen=True)
class Injection:
    """The spec fields to replace, and warnings for whoever created the pod."""

    spec: Mapping[str, Any]
    warnings: tuple[str, ...] = ()


def injection_for(pod: Mapping[str, Any], runtime: RuntimeImage) -> Injection:
    """What to change in ``pod`` (an admission request's object) to inject the runtime."""
    targets = runtime_targets(pod)
    if not targets:
        return Injection(
            spec={},
            warnings=(
                f"{names.LABEL_INJECT}=true is set but no container requests "
                f"{names.RESOURCE_GPU}; kvshare injected nothing",
            ),
        )
    injected = inject_runtime(pod, runtime, targets)["spec"]
    original = pod.get("spec") or {}
    warnings: tuple[str, ...] = ()
    if not _requests_gpu_memory(pod):
        warnings = (
            f"no container requests {names.RESOURCE_GPU_MEMORY}: the node agent admits a pool "
            "only within its pod's request (its static memory and kv min); request the GiB "
            "your engine needs per GPU",
        )
    return Injection(
        spec={k: injected[k] for k in INJECTED_FIELDS if injected.get(k) != original.get(k)},
        warnings=warnings,
    )


def _requests_gpu_memory(pod: Mapping[str, Any]) -> bool:
    for container in (pod.get("spec") or {}).get("containers") or ():
        resources = container.get("resources") or {}
        if any(
            names.RESOURCE_GPU_MEMORY in (resources.get(k) or {}) for k in ("requests", "limits")
        ):
            return True
    return False
