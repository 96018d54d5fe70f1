"""The kopf handlers: each translates an event into a call of the controller.

- Indexes keep small views of ModelServers, the operator's own pods, Nodes and
  KVShareNodes; kopf fills them from its watches and holds every handler back until all
  of them are loaded, so the first reconcile after a restart already sees every pod.
- A ModelServer event reconciles that ModelServer (or forgets it, when deleted); one
  that appears or goes also reconciles those whose colocation rules name it.
- A pod event reconciles the pod's ModelServer (readiness, failures, deletions); a pod
  that is gone also frees GPU room, so the ModelServers waiting for capacity retry.
- A ResourceQuota event reconciles the ModelServers whose last pod it refused (the
  quota may have room now).
- A KVShareNode event reconciles the ModelServers with pods on that node (their KV
  usage) and those waiting for GPU capacity; a Node event, only the latter, and only
  when the node's labels, taints or cordon changed.
- The admission webhook (only with a certificate) injects the runtime into user pods.

No handler is a daemon or a timer, and none handles deletion, so kopf puts no finalizer
on ModelServers: deleting one never waits for the operator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import kopf

from kvshare.api import names
from kvshare.operator.caches import Caches
from kvshare.operator.connection import connection_info
from kvshare.operator.controller import Controller
from kvshare.operator.quota import QuotaView
from kvshare.operator.server import HttpEndpoint
from kvshare.operator.settings import OperatorConfig
from kvshare.operator.status import Event
from kvshare.operator.views import (
    GpuNodeView,
    ModelServerKey,
    ModelServerRef,
    PodView,
    node_view,
    pod_view,
)
from kvshare.operator.webhook import injection_for

if TYPE_CHECKING:
    from kubernetes.client import Configuration

__all__ = ["build_registry"]

_MODELSERVERS = (names.GROUP, names.VERSION, names.MODELSERVER_PLURAL)
_KVSHARENODES = (names.GROUP, names.VERSION, names.KVSHARENODE_PLURAL)
_OWN_PODS = {names.LABEL_MANAGED_BY: names.MANAGED_BY}


def _caches(kwargs: Mapping[str, Any]) -> Caches:
    return Caches(
        modelservers=kwargs["kvshare_modelservers"],
        pods=kwargs["kvshare_pods"],
        pods_by_node=kwargs["kvshare_pods_by_node"],
        nodes=kwargs["kvshare_nodes"],
        gpu_nodes=kwargs["kvshare_gpu_nodes"],
        quotas=kwargs["kvshare_quotas"],
    )


def _post_event(ms: ModelServerRef, event: Event) -> None:
    kopf.event(
        kopf.Body(cast(kopf.RawBody, ms.body())),
        type=event.type,
        reason=event.reason,
        message=event.message,
    )


async def _reconcile_all(
    controller: Controller, keys: Iterable[ModelServerKey], caches: Caches
) -> None:
    """Reconcile each of ``keys`` (concurrently: runs of one key are serialized anyway)."""
    await asyncio.gather(*(controller.request(k, caches, _post_event) for k in keys))


def build_registry(
    config: OperatorConfig,
    controller: Controller,
    endpoint: HttpEndpoint,
    configuration: Configuration,
) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(configuration)

    @kopf.on.startup(registry=registry)
    async def start_endpoint(**_: Any) -> None:
        await endpoint.start()
        endpoint.started = True

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        await endpoint.stop()
        controller.close()
        controller.api.close()

    # --- indexes ----------------------------------------------------------------------

    @kopf.index(*_MODELSERVERS, id="kvshare_modelservers", registry=registry)
    def index_modelserver(body: kopf.Body, **_: Any) -> dict[tuple[str, str], ModelServerRef]:
        ref = ModelServerRef.from_body(body)
        return {ref.key: ref}

    @kopf.index("v1", "pods", labels=_OWN_PODS, id="kvshare_pods", registry=registry)
    def index_pod(body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodView] | None:
        view = pod_view(body)
        return {view.key: view} if view else None

    @kopf.index("v1", "pods", labels=_OWN_PODS, id="kvshare_pods_by_node", registry=registry)
    def index_pod_node(body: kopf.Body, **_: Any) -> dict[str, tuple[str, str]] | None:
        view = pod_view(body)
        return {view.node: view.key} if view else None

    @kopf.index("v1", "nodes", id="kvshare_nodes", registry=registry)
    def index_node(body: kopf.Body, name: str, **_: Any) -> dict[str, Any]:
        return {name: node_view(body)}

    @kopf.index(*_KVSHARENODES, id="kvshare_gpu_nodes", registry=registry)
    def index_gpu_node(body: kopf.Body, **_: Any) -> dict[str, GpuNodeView] | None:
        view = GpuNodeView.from_body(body)
        return {view.node: view} if view else None

    @kopf.index("v1", "resourcequotas", id="kvshare_quotas", registry=registry)
    def index_quota(body: kopf.Body, **_: Any) -> dict[tuple[str, str], QuotaView]:
        view = QuotaView.from_body(body)
        return {(view.namespace, view.name): view}

    # --- events -----------------------------------------------------------------------

    @kopf.on.event(*_MODELSERVERS, registry=registry)
    async def modelserver_changed(
        type: str, namespace: str | None, name: str, **kwargs: Any
    ) -> None:
        key = (namespace or "", name)
        if type == "DELETED":
            controller.forget(key)
        caches = _caches(kwargs)
        await _reconcile_all(
            controller, controller.affected_by_modelserver(type, key, caches), caches
        )

    @kopf.on.event("v1", "pods", labels=_OWN_PODS, registry=registry)
    async def pod_changed(
        type: str, namespace: str | None, labels: kopf.Labels, **kwargs: Any
    ) -> None:
        keys = controller.affected_by_pod(type, namespace, labels.get(names.LABEL_MODELSERVER))
        await _reconcile_all(controller, keys, _caches(kwargs))

    @kopf.on.event(*_KVSHARENODES, registry=registry)
    async def gpu_node_changed(body: kopf.Body, name: str, **kwargs: Any) -> None:
        caches = _caches(kwargs)
        node = (body.get("spec") or {}).get("nodeName") or name
        await _reconcile_all(controller, controller.affected_by_gpu_node(node, caches), caches)

    @kopf.on.event("v1", "resourcequotas", registry=registry)
    async def quota_changed(namespace: str | None, name: str, **kwargs: Any) -> None:
        keys = controller.affected_by_quota(namespace, name)
        await _reconcile_all(controller, keys, _caches(kwargs))

    @kopf.on.event("v1", "nodes", registry=registry)
    async def node_changed(body: kopf.Body, **kwargs: Any) -> None:
        keys = controller.affected_by_node(node_view(body))
        await _reconcile_all(controller, keys, _caches(kwargs))

    # --- admission ----------------------------------------------------------------------

    if config.webhook_cert_dir is not None:

        @kopf.on.mutate(
            "v1",
            "pods",
            id=names.WEBHOOK_INJECT_PATH.strip("/"),
            operations=["CREATE"],
            labels={names.LABEL_INJECT: "true"},
            registry=registry,
        )
        def inject(body: kopf.Body, patch: kopf.Patch, warnings: list[str], **_: Any) -> None:
            injection = injection_for(body, config.runtime)
            if injection.spec:
                patch["spec"] = dict(injection.spec)
            warnings.extend(injection.warnings)

    return registry
