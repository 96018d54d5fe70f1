"""Every Kubernetes API call the operator makes, as data: the source of its RBAC rules.

The list covers the operator's own calls (:mod:`.client`) and kopf's on its behalf
(watches, Events, peering, CRD discovery). The operator's tests record every request
the running operator sends to the emulated API server and check that each one is listed
here; the Helm chart generates its ClusterRole from :func:`rbac_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshare.api import names

__all__ = ["API_CALLS", "NAMESPACED_PEERING_CALLS", "ApiCall", "rbac_rules"]


@dataclass(frozen=True)
class ApiCall:
    """Verbs the operator uses on one resource (``plural`` or ``plural/subresource``)."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str


API_CALLS: tuple[ApiCall, ...] = (
    ApiCall(names.GROUP, names.MODELSERVER_PLURAL, ("list", "watch"), "the ModelServers to serve"),
    ApiCall(names.GROUP, f"{names.MODELSERVER_PLURAL}/status", ("patch",), "their status"),
    ApiCall(
        names.GROUP,
        f"{names.MODELSERVER_PLURAL}/finalizers",
        ("update",),
        "owner references with blockOwnerDeletion, where OwnerReferencesPermissionEnforcement "
        "is enabled (the operator itself sets no finalizer)",
    ),
    ApiCall(names.GROUP, names.KVSHARENODE_PLURAL, ("list", "watch"), "GPU capacity and pools"),
    ApiCall(
        "",
        "pods",
        ("list", "watch", "create", "delete", "patch"),
        "one pod per replica (patch: its KV policy annotation, changed in place)",
    ),
    ApiCall(
        "",
        "services",
        ("create", "get", "patch"),
        "one Service per ModelServer (get: whose is one that exists already)",
    ),
    ApiCall("", "nodes", ("list", "watch"), "labels, taints and cordons for placement"),
    ApiCall(
        "",
        "resourcequotas",
        ("list", "watch"),
        "retry pods a namespace quota refused once it has room",
    ),
    ApiCall("", "events", ("create",), "Events about placement, rollouts and problems"),
    ApiCall(
        "kopf.dev",
        "clusterkopfpeerings",
        ("list", "watch", "patch"),
        "peering: one active operator replica",
    ),
    ApiCall(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "kopf notices the kvshare CRDs appear (e.g. installed after the operator)",
    ),
)

#: With ``--namespace``, peering goes through a KopfPeering in each served namespace.
NAMESPACED_PEERING_CALLS: tuple[ApiCall, ...] = (
    ApiCall("kopf.dev", "kopfpeerings", ("list", "watch", "patch"), "peering per namespace"),
)


def rbac_rules(calls: tuple[ApiCall, ...] = API_CALLS) -> list[dict[str, Any]]:
    """``calls`` as ClusterRole rules (one per resource, in order)."""
    return [
        {"apiGroups": [call.group], "resources": [call.resource], "verbs": list(call.verbs)}
        for call in calls
    ]
