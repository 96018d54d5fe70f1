"""A Kubernetes API for the operator's tests: kmock's emulator with what kopf relies on.

kmock (by kopf's author) serves the Kubernetes API over real HTTP from memory. Its
emulator is extended here the way kmock documents, by subclassing, and only through
its public surface (``_handle`` is the request hook subclasses override; ``resources``
and ``objects`` are the public stores):

- server-set metadata on create: ``uid``, ``resourceVersion``, ``generation``,
  ``creationTimestamp``, the namespace from the URL, and ``generateName``;
- on patch: a new ``resourceVersion``, ``generation`` bumped when anything but metadata
  and status changed, the status subresource split (``/status`` changes only status,
  the main resource never changes it), and 422 for a failed JSON-patch ``test``;
- 201 for a create (kmock answers 200);
- ResourceQuota admission of pods: a pod whose container requests would take a quota's
  ``requests.*`` (or plain) resources over ``spec.hard``, counting the namespace's other
  pods that have not finished, is refused with the API server's 403 and its exact
  ``exceeded quota: ...`` message; and the quota controller's part: after every change
  to the namespace's pods or quotas, each quota's ``status.hard`` and ``status.used``
  are recounted and written (a watch event, as in a cluster);
- the ``scale`` subresource of custom resources that declare one (get, patch and put of an
  ``autoscaling/v1`` Scale, mapped through the CRD's replica and selector paths, as
  ``kubectl scale``, a HorizontalPodAutoscaler and KEDA use it);
- a constant-time request match: kmock checks each request against its whole request
  history once per registered reaction; this emulator shows reactions only the requests
  in flight, so every request costs the same however long a test runs. Reactions that
  filter requests work as before; history-based views (slices, counts) see only
  requests in flight, and the tests use :attr:`KubeCluster.api_calls` instead.

What kmock does not do and no test here relies on: label/field selectors, watch
resumption, garbage collection (owned objects stay when their owner goes; the tests
check owner references, ``tests/e2e`` the real deletion), graceful pod termination.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import secrets
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock

from kvshare.api.crds import all_crds
from kvshare.api.quantity import parse_quantity

__all__ = ["ApiCall", "KubeCluster", "declare_resources"]

#: What the real API server answers each write with.
_CREATED = 201


@dataclass(frozen=True)
class ApiCall:
    """One request to the API: who made it and what it touched."""

    verb: str
    group: str
    resource: str
    """Plural, with ``/subresource`` when one was addressed."""
    namespace: str | None
    name: str | None
    user_agent: str
    at: float
    """When it arrived (``time.monotonic()``)."""


_VERBS = {
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.FETCH: "get",
    kmock.action.CREATE: "create",
    kmock.action.UPDATE: "patch",
    kmock.action.DELETE: "delete",
}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``None`` removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def _generation_fields(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class KubeCluster(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with server-set metadata and API-server answers."""

    api_calls: list[ApiCall] = attrs.field(factory=list, init=False)
    #: Resource -> its CRD's scale subresource (``specReplicasPath`` and so on).
    scales: dict[kmock.resource, dict[str, str]] = attrs.field(factory=dict, init=False)
    _in_flight: list[kmock.Request] = attrs.field(factory=list, init=False)
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __iter__(self) -> Any:
        # The requests reactions are matched against: only those being served.
        return iter(list(self._in_flight))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self._in_flight.append(request)
        try:
            if request.subresource == "scale" and request.resource in self.scales:
                return await self._serve_scale(request)
            if request.resource is not None and request.action is not None:
                self._record(request)  # refused requests count too
                if request.action == kmock.action.CREATE:
                    if request.resource == _PODS:
                        self._admit_to_quotas(request)
                    self._stamp_create(request)
                if request.action == kmock.action.UPDATE and request.name:
                    self._stamp_patch(request)
            response = await super()._handle(request)
            if request.action == kmock.action.CREATE and response.status == 200:
                response.set_status(_CREATED)
            if response.status < 400 and self._counts_for_quotas(request):
                await self._recount_quotas(request)
            return response
        finally:
            self._in_flight.remove(request)

    async def _serve_scale(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The scale subresource: an ``autoscaling/v1`` Scale read from, and written to,
        the object's replica paths. A write goes through as a patch of the object itself
        (a new generation and a watch event, as a spec change)."""
        assert request.resource is not None
        paths = self.scales[request.resource]
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message="not found")
        if request.method in (kmock.method.PATCH, kmock.method.PUT):
            replicas = ((request.data or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message=f"spec.replicas: {replicas!r}"
                )
            patch: dict[str, Any] = {}
            node = patch
            *parents, leaf = paths["specReplicasPath"].strip(".").split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = replicas
            await self._handle(
                attrs.evolve(
                    request,
                    method=kmock.method.PATCH,
                    action=kmock.action.UPDATE,
                    subresource=None,
                    data=patch,
                )
            )
        elif request.method != kmock.method.GET:
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="")
        return aiohttp.web.json_response(_scale_of(self.objects[key].raw, paths))

    def _admit_to_quotas(self, request: kmock.Request) -> None:
        """Refuse the pod as the ResourceQuota admission plugin does when it would exceed
        a quota of its namespace."""
        pod = request.data if isinstance(request.data, dict) else {}
        namespace = request.namespace or (pod.get("metadata") or {}).get("namespace")
        asked = pod_requests(pod)
        for quota in self.live(_QUOTAS, namespace):
            limits = (quota.get("spec") or {}).get("hard") or {}
            hard = {k: parse_quantity(v) for k, v in limits.items()}
            requested = {k: asked[_resource_of(k)] for k in hard if _resource_of(k) in asked}
            used = quota_usage(self.live(_PODS, namespace), requested)
            exceeded = sorted(k for k in requested if used[k] + requested[k] > hard[k])

            def listed(amounts: dict[str, Fraction], keys: list[str] = exceeded) -> str:
                return ",".join(f"{k}={_quantity(amounts[k])}" for k in keys)

            if exceeded:
                name = (pod.get("metadata") or {}).get("name", "")
                raise kmock.KubernetesError(
                    status=403,
                    reason="Forbidden",
                    message=(
                        f'pods "{name}" is forbidden: exceeded quota: '
                        f"{quota['metadata']['name']}, requested: {listed(requested)}, "
                        f"used: {listed(used)}, limited: {listed(hard)}"
                    ),
                    details={"name": name, "kind": "pods"},
                )

    @staticmethod
    def _counts_for_quotas(request: kmock.Request) -> bool:
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        counted = request.resource in (_PODS, kmock.resource(_QUOTAS))
        return counted and request.action in writes and request.subresource is None

    async def _recount_quotas(self, cause: kmock.Request) -> None:
        """The quota controller: write each quota's hard limits and current usage."""
        namespace = cause.namespace or _namespace_of(cause)
        for quota in self.live(_QUOTAS, namespace):
            hard = (quota.get("spec") or {}).get("hard") or {}
            used = quota_usage(self.live("v1/pods", namespace), hard)
            status = {"hard": hard, "used": {k: _quantity(v) for k, v in used.items()}}
            if quota.get("status") == status:
                continue
            await self._handle(
                attrs.evolve(
                    cause,
                    method=kmock.method.PATCH,
                    action=kmock.action.UPDATE,
                    resource=kmock.resource(_QUOTAS),
                    namespace=namespace,
                    name=quota["metadata"]["name"],
                    subresource="status",
                    headers={"User-Agent": "kube-controller-manager/resourcequota-controller"},
                    data={"status": status},
                )
            )

    def live(self, resource: str, namespace: str | None) -> list[dict[str, Any]]:
        """The objects of ``resource`` in ``namespace`` that are not deleted."""
        wanted = kmock.resource(resource)
        return [
            obj.raw
            for (res, ns, _), obj in self.objects.items()
            if res == wanted and ns == namespace and not obj.deleted
        ]

    def _record(self, request: kmock.Request) -> None:
        assert request.resource is not None and request.action is not None
        plural = request.resource.plural or ""
        body = request.data if isinstance(request.data, dict) else {}
        self.api_calls.append(
            ApiCall(
                verb=_VERBS[request.action],
                group=request.resource.group or "",
                resource=f"{plural}/{request.subresource}" if request.subresource else plural,
                namespace=request.namespace,
                name=request.name or (body.get("metadata") or {}).get("name"),
                user_agent=request.headers.get("User-Agent", ""),
                at=time.monotonic(),
            )
        )

    def _stamp_create(self, request: kmock.Request) -> None:
        data = request.data
        if not isinstance(data, dict):
            return
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = _now()

    def _stamp_patch(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key].raw
        data = request.data
        with_status = (
            request.resource in self.resources
            and "status" in self.resources[request.resource].subresources
        )
        if isinstance(data, dict) and with_status:
            kept = {"status"} if request.subresource == "status" else set(data) - {"status"}
            for field in set(data) - kept:
                del data[field]
        try:
            if isinstance(data, list):
                patched = jsonpatch.apply_patch(current, data, in_place=False)
            else:
                patched = _merge(current, data)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
        stamps = {"resourceVersion": str(next(self._versions))}
        if _generation_fields(patched) != _generation_fields(current):
            stamps["generation"] = int(current.get("metadata", {}).get("generation") or 1) + 1
        if isinstance(data, list):
            data.extend(
                {"op": "add", "path": f"/metadata/{field}", "value": value}
                for field, value in stamps.items()
            )
        elif isinstance(data, dict):
            meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
            data["metadata"] = {**meta, **stamps}


_PODS = kmock.resource("v1/pods")
_QUOTAS = "v1/resourcequotas"


def _resource_of(quota_key: str) -> str:
    """The pod resource a quota key counts (``requests.cpu`` and ``cpu``: ``cpu``)."""
    return quota_key.removeprefix("requests.")


def _quantity(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def pod_requests(pod: dict[str, Any]) -> dict[str, Fraction]:
    """What a pod's containers request, summed per resource (plus ``pods``: 1)."""
    total: dict[str, Fraction] = {"pods": Fraction(1)}
    for container in (pod.get("spec") or {}).get("containers") or ():
        for resource, amount in ((container.get("resources") or {}).get("requests") or {}).items():
            total[resource] = total.get(resource, Fraction(0)) + parse_quantity(amount)
    return total


def quota_usage(pods: list[dict[str, Any]], keys: Any) -> dict[str, Fraction]:
    """What ``pods`` that have not finished use of each quota key in ``keys``."""
    used = dict.fromkeys(keys, Fraction(0))
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        asked = pod_requests(pod)
        for key in used:
            used[key] += asked.get(_resource_of(key), Fraction(0))
    return used


def _namespace_of(request: kmock.Request) -> str | None:
    data = request.data if isinstance(request.data, dict) else {}
    return (data.get("metadata") or {}).get("namespace")


def _at(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _scale_of(obj: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """The ``autoscaling/v1`` Scale of ``obj``, as the API server builds it."""
    meta = obj.get("metadata", {})
    status: dict[str, Any] = {"replicas": _at(obj, paths["statusReplicasPath"]) or 0}
    selector = _at(obj, paths.get("labelSelectorPath", ""))
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        },
        "spec": {"replicas": _at(obj, paths["specReplicasPath"]) or 0},
        "status": status,
    }


def declare_resources(cluster: KubeCluster) -> None:
    """Every resource the operator touches, as a real API server would list them.

    The kvshare resources come from the generated CRDs, which are also stored as objects.
    """
    core = {
        "pods": ("Pod", True, {"status"}),
        "services": ("Service", True, {"status"}),
        "events": ("Event", True, set()),
        "nodes": ("Node", False, {"status"}),
        "resourcequotas": ("ResourceQuota", True, {"status"}),
        "namespaces": ("Namespace", False, {"status"}),
    }
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    for plural, (kind, namespaced, subresources) in core.items():
        cluster.resources[f"v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, subresources=subresources, verbs=verbs
        )
    cluster.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs
    )
    cluster.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs=verbs, subresources=set()
    )
    for crd in all_crds():
        spec = crd["spec"]
        version = spec["versions"][0]
        resource = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
        if "scale" in version.get("subresources", {}):
            cluster.scales[kmock.resource(resource)] = version["subresources"]["scale"]
        cluster.resources[resource] = kmock.ResourceInfo(
            kind=spec["names"]["kind"],
            singular=spec["names"]["singular"],
            namespaced=spec["scope"] == "Namespaced",
            shortnames=set(spec["names"].get("shortNames", [])),
            categories=set(spec["names"].get("categories", [])),
            subresources=set(version.get("subresources", {})),
            verbs=verbs,
        )
        cluster.objects[
            "apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]
        ] = {
            **crd,
            "metadata": {**crd["metadata"], "uid": str(uuid.uuid4()), "resourceVersion": "1"},
        }
