"""Reconcile one ModelServer: read the caches, plan, act, write status, report.

:class:`Controller` is the only place where the pure parts (:mod:`.plan`,
:mod:`.render`, :mod:`.status`) meet the API. A reconcile is level-triggered and
idempotent: it reads the ModelServer and every relevant object from kopf's watch-fed
indexes (:class:`Caches`), never from the event that triggered it, so a run with nothing
to do makes no API call, and a restarted operator picks up where the last one stopped.
Runs of one ModelServer are serialized by a :class:`~.keyed.KeyedRunner`. Besides watch
events, one thing starts a run: the end of a failed replica's back-off (:mod:`.backoff`),
for which the controller keeps a timer per ModelServer on the event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvshare.api import names
from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import EngineVersionError, ModelServerSpec
from kvshare.api.placement import Placement
from kvshare.api.quantity import format_bytes_human
from kvshare.operator.backoff import FailureBackoff, ReplicaFailures
from kvshare.operator.capacity import Capacity, build_capacity, group_of
from kvshare.operator.client import (
    ApiError,
    KubeApi,
    modelserver_status_path,
    pods_path,
    services_path,
)
from kvshare.operator.expectations import Expectations
from kvshare.operator.inplace import (
    ReplicaPolicy,
    WantedPolicy,
    pods_to_annotate,
    refused_replicas,
    replica_policies,
    wanted_policy,
)
from kvshare.operator.keyed import KeyedRunner
from kvshare.operator.metrics import ModelServerSample, OperatorMetrics
from kvshare.operator.plan import Create, Delete, Plan, desired_replicas, plan_replicas
from kvshare.operator.quota import QuotaRefusal, QuotaView, quota_refusal
from kvshare.operator.render import (
    RuntimeImage,
    endpoint,
    pod_selector,
    render_pod,
    render_service,
    selector_string,
    template_hash,
)
from kvshare.operator.status import (
    Event,
    Observation,
    Problem,
    compute_status,
    condition_events,
    kv_usage,
    placement_events,
    with_problem,
)
from kvshare.operator.views import (
    GpuNodeView,
    ModelServerKey,
    ModelServerRef,
    NodeView,
    PodView,
    pod_view,
)

__all__ = ["MAX_NAME_LENGTH", "Caches", "Controller", "EventSink"]

log = logging.getLogger(__name__)

#: Longest ModelServer name: pod "<name>-<replica>" (replica < 1024) and the Service
#: named after it must stay valid DNS labels (63 characters).
MAX_NAME_LENGTH = 58

#: Posts a Kubernetes Event about a ModelServer.
EventSink = Callable[[ModelServerRef, Event], None]


@dataclass(frozen=True)
class Caches:
    """Read-only views of the cluster, kept current by kopf's indexes (key -> values)."""

    modelservers: Mapping[ModelServerKey, Collection[ModelServerRef]]
    pods: Mapping[ModelServerKey, Collection[PodView]]
    pods_by_node: Mapping[str, Collection[ModelServerKey]]
    nodes: Mapping[str, Collection[NodeView]]
    gpu_nodes: Mapping[str, Collection[GpuNodeView]]
    quotas: Mapping[tuple[str, str], Collection[QuotaView]]
    """ResourceQuotas by (namespace, name)."""

    def modelserver(self, key: ModelServerKey) -> ModelServerRef | None:
        return next(iter(self.modelservers.get(key, ())), None)

    def node_views(self) -> dict[str, NodeView]:
        return {name: view for name, views in self.nodes.items() for view in views}

    def gpu_node_views(self) -> list[GpuNodeView]:
        return [view for views in self.gpu_nodes.values() for view in views]

    def all_pods(self) -> list[PodView]:
        return [pod for pods in self.pods.values() for pod in pods]

    def quota(self, namespace: str, name: str) -> QuotaView | None:
        return next(iter(self.quotas.get((namespace, name), ())), None)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _validate(ms: ModelServerRef) -> tuple[ModelServerSpec | None, Problem | None]:
    """The spec, or the problem that keeps it from being served."""
    try:
        spec = validate(ModelServerSpec, ms.spec, kind="ModelServer spec")
    except SpecError as exc:
        return None, Problem("InvalidSpec", "; ".join(exc.problems))
    if len(ms.name) > MAX_NAME_LENGTH:
        return spec, Problem(
            "NameTooLong",
            f"the name has {len(ms.name)} characters; at most {MAX_NAME_LENGTH} fit in the "
            "names of its pods and Service: recreate it with a shorter name",
        )
    try:
        spec.engine_version_resolved()
    except EngineVersionError as exc:
        return spec, Problem("UnsupportedEngineVersion", str(exc))
    return spec, None


def _missing_refs(
    ms: ModelServerRef, spec: ModelServerSpec, caches: Caches
) -> dict[str, list[str]]:
    """The ModelServers ``spec``'s colocation rules name that do not exist, by field."""
    missing = {}
    for field, named in (
        ("colocateWith", spec.colocate_with),
        ("avoidColocationWith", spec.avoid_colocation_with),
    ):
        absent = []
        for name in named:
            other = caches.modelserver((ms.namespace, name))
            if other is None or other.deleting:
                absent.append(name)
        if absent:
            missing[field] = absent
    return missing


def _names_in_colocation_rules(ms: ModelServerRef) -> set[str]:
    named: set[str] = set()
    for field in ("colocateWith", "avoidColocationWith"):
        value = ms.spec.get(field)
        if isinstance(value, list):
            named.update(n for n in value if isinstance(n, str))
    return named


def _raw_replicas(ms: ModelServerRef) -> int:
    """The replica count of a spec that did not validate, when it is readable at all."""
    replicas = ms.spec.get("replicas", 1)
    return replicas if isinstance(replicas, int) and replicas >= 0 else 0


def _status_patch(previous: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that turns ``previous`` into ``status`` (removed keys set to null)."""
    patch: dict[str, Any] = dict(status)
    for key in previous:
        patch.setdefault(key, None)
    return {"status": patch}


class Controller:
    """Reconciles ModelServers; one instance per operator process."""

    def __init__(
        self,
        api: KubeApi,
        runtime: RuntimeImage,
        metrics: OperatorMetrics,
        retry_delays: Iterable[float] = (0.5, 1, 2, 5, 10, 30),
        backoff: FailureBackoff | None = None,
    ) -> None:
        self.api = api
        self.runtime = runtime
        self.metrics = metrics
        self.expectations = Expectations()
        self.backoff = backoff or FailureBackoff()
        self.runner: KeyedRunner[ModelServerKey] = KeyedRunner(
            self._reconcile_once, self._report_failure, tuple(retry_delays)
        )
        # Per-ModelServer memory; touched on the event loop's thread only.
        self._caches: Caches | None = None
        self._emit: EventSink = lambda ms, event: None
        self._services: dict[ModelServerKey, dict[str, Any]] = {}
        # The status last written: newer than the index until the watch event arrives.
        self._statuses: dict[ModelServerKey, dict[str, Any]] = {}
        self._waiting_for_capacity: set[ModelServerKey] = set()
        # The KV-policy annotation last written, and the pods (by uid) given it.
        self._annotated: dict[ModelServerKey, tuple[str, set[str]]] = {}
        # The last pod refused for an exhausted namespace quota while replicas are missing,
        # and the quota as the watch showed it then: no pod is created for the ModelServer
        # until the quota changes and has room for it.
        self._quota_waits: dict[ModelServerKey, tuple[QuotaRefusal, QuotaView | None]] = {}
        self._node_views: dict[str, NodeView] = {}
        # A reconcile due when a held-back replica may be replaced: nothing else may happen
        # to the ModelServer until then, so no watch event would bring it.
        self._wake_ups: dict[ModelServerKey, asyncio.TimerHandle] = {}
        self._woken: set[asyncio.Task[None]] = set()

    # --- entry points (called by the kopf handlers) --------------------------------

    async def request(self, key: ModelServerKey, caches: Caches, emit: EventSink) -> None:
        """Reconcile ``key`` now or right after the run in progress."""
        # The indexes are live objects; any handler's reference to them is current.
        self._caches = caches
        self._emit = emit
        await self.runner.request(key)

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` was deleted: drop what the operator remembers of it.

        Its pods and Service go with it through their owner references (the garbage
        collector's job); nothing needs the API, so no finalizer holds the deletion.
        """
        self.expectations.forget(key)
        self._services.pop(key, None)
        self._statuses.pop(key, None)
        self._waiting_for_capacity.discard(key)
        self._quota_waits.pop(key, None)
        self._annotated.pop(key, None)
        self.backoff.forget(key)
        self._wake_later(key, None)
        self.metrics.forget(key)
        log.info("forgot ModelServer %s/%s", *key)

    def close(self) -> None:
        """The operator stops: drop the reconciles due later."""
        for key in list(self._wake_ups):
            self._wake_later(key, None)
        for task in list(self._woken):
            task.cancel()

    def affected_by_modelserver(
        self, event: str | None, key: ModelServerKey, caches: Caches
    ) -> set[ModelServerKey]:
        """ModelServers a ModelServer event matters to: its own (unless it was deleted),
        and when one appears or goes, those of its namespace whose colocation rules name it."""
        keys = set() if event == "DELETED" else {key}
        if event in ("ADDED", "DELETED"):
            namespace, name = key
            for refs in caches.modelservers.values():
                keys.update(
                    ref.key
                    for ref in refs
                    if ref.namespace == namespace
                    and ref.key != key
                    and name in _names_in_colocation_rules(ref)
                )
        return keys

    def affected_by_pod(
        self, event: str, namespace: str | None, modelserver: str | None
    ) -> set[ModelServerKey]:
        """ModelServers a pod event matters to: its own, and when the pod is gone (its
        GPU room is free again) those waiting for capacity."""
        keys = {(namespace, modelserver)} if namespace and modelserver else set()
        if event == "DELETED":
            keys |= self._waiting_for_capacity
        return keys

    def affected_by_gpu_node(self, node: str, caches: Caches) -> set[ModelServerKey]:
        """ModelServers a KVShareNode change matters to: those with pods on the node
        (their KV usage) and those waiting for capacity."""
        return set(caches.pods_by_node.get(node, ())) | self._waiting_for_capacity

    def affected_by_quota(self, namespace: str | None, name: str) -> set[ModelServerKey]:
        """ModelServers a ResourceQuota change matters to: those refused by it."""
        return {
            key
            for key, (refusal, _) in self._quota_waits.items()
            if key[0] == namespace and refusal.quota == name
        }

    def affected_by_node(self, view: NodeView) -> set[ModelServerKey]:
        """ModelServers a Node change matters to: those waiting for capacity, and only
        when what placement reads (labels, taints, cordon) changed."""
        if self._node_views.get(view.name) == view:
            return set()
        self._node_views[view.name] = view
        return set(self._waiting_for_capacity)

    # --- one reconcile -------------------------------------------------------------

    async def _reconcile_once(self, key: ModelServerKey) -> None:
        caches = self._caches
        assert caches is not None
        ms = caches.modelserver(key)
        if ms is None or ms.deleting:
            return  # deleted, or being deleted: the garbage collector takes the rest
        started = time.perf_counter()
        try:
            await self._reconcile(ms, caches)
        except ApiError:
            self.metrics.reconcile_errors.inc()
            raise
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    async def _reconcile(self, ms: ModelServerRef, caches: Caches) -> None:
        pods = self.expectations.overlay(caches.pods.get(ms.key, ()), ms.key)
        previous = self._statuses.get(ms.key, ms.status)
        spec, problem = _validate(ms)
        events: list[Event] = []
        plan = None
        failures = ReplicaFailures()
        pools = [
            pool
            for view in caches.gpu_node_views()
            for gpu in view.status.gpus
            for pool in gpu.pools
            if pool.namespace == ms.namespace and pool.modelserver == ms.name
        ]
        policies: dict[int, ReplicaPolicy] = {}
        if spec is not None and problem is None:
            template = template_hash(spec)
            wanted = wanted_policy(spec.kv_cache)
            failures = self.backoff.observe(ms.key, pods, template, spec.replicas)
            plan = plan_replicas(
                desired_replicas(ms.namespace, ms.name, spec, template),
                pods,
                lambda: self._capacity(caches),
                failures.held,
                refused_replicas(replica_policies(pods, pools, wanted)),
            )
            plan = self._hold_for_quota(ms.key, plan, caches)
            self._count_placements(plan)
            pods, problem = await self._execute(ms, spec, plan, pods, events)
            problem = await self._ensure_service(ms, spec) or problem
            await self._annotate(ms, pods, wanted, events)
            policies = replica_policies(pods, pools, wanted)
        refused = self._quota_waits.get(ms.key, (None, None))[0]
        observation = Observation(
            generation=ms.generation,
            desired=spec.replicas if spec is not None else _raw_replicas(ms),
            pods=pods,
            plan=plan,
            problem=problem,
            quota=refused.describe() if refused is not None else None,
            kv_policy=policies,
            kv=kv_usage(pools),
            endpoint=endpoint(ms, spec) if spec is not None else None,
            selector=selector_string(pod_selector(ms)),
            failing=failures.failing,
            namespace=ms.namespace,
            missing_refs=_missing_refs(ms, spec, caches) if spec is not None else None,
        )
        status = compute_status(observation, previous, _now())
        self._track_capacity_wait(ms.key, plan)
        self._wake_later(ms.key, failures.wake_in)
        events += condition_events(previous.get("conditions") or [], status["conditions"])
        events += placement_events(previous.get("placements") or [], status["placements"])
        events += self._scale_event(previous, spec)
        if status != previous:
            await self.api.merge_patch(
                modelserver_status_path(ms.namespace, ms.name),
                _status_patch({**ms.status, **previous}, status),
            )
            self._statuses[ms.key] = status
        if caches.modelserver(ms.key) is not None:  # not deleted while this run awaited
            self.metrics.observe(
                ms.key,
                ModelServerSample(
                    phase=status["phase"],
                    desired=observation.desired,
                    ready=status["readyReplicas"],
                    kv=observation.kv,
                ),
            )
        for event in events:
            log.info("%s/%s: %s: %s", ms.namespace, ms.name, event.reason, event.message)
            self._emit(ms, event)

    async def _annotate(
        self, ms: ModelServerRef, pods: list[PodView], wanted: WantedPolicy, events: list[Event]
    ) -> None:
        """Write the current KV policy into the pods that do not carry it: the node agent
        applies it to their pools in place."""
        # Pods patched already, until the watch shows the annotation: not patched twice.
        done = self._annotated.get(ms.key)
        if done is None or done[0] != wanted.annotation:
            done = self._annotated[ms.key] = (wanted.annotation, set())
        done[1].difference_update(p.uid for p in pods if p.kv_policy == wanted.annotation)
        stale = [p for p in pods_to_annotate(pods, wanted) if p.uid not in done[1]]
        patch = {"metadata": {"annotations": {names.ANNOTATION_KV_POLICY: wanted.annotation}}}
        patched = []
        for pod in stale:
            if await self.api.merge_patch(pods_path(ms.namespace, pod.name), patch) is not None:
                done[1].add(pod.uid)
                patched.append(pod.name)
        if patched:
            events.append(
                Event(
                    "Normal",
                    "KVPolicyChanged",
                    f"applying kvCache {wanted.description} in place to {len(patched)} "
                    f"replica(s): {', '.join(patched[:5])}",
                )
            )

    def _kv_capacity(
        self, caches: Caches, spec: ModelServerSpec, placement: Placement
    ) -> int | None:
        """The most KV cache per worker the replica's GPUs could ever lend it (the pool's
        virtual size, up to which kvCache.max can be raised in place)."""
        usable = [
            gpu.total - gpu.headroom
            for view in caches.gpu_node_views()
            if view.node == placement.node
            for gpu in view.status.gpus
            if gpu.uuid in placement.gpus
        ]
        if len(usable) != len(placement.gpus) or not usable:
            return None
        return max(min(usable) - spec.static_bytes_per_worker(), spec.kv_cache.min)

    def _capacity(self, caches: Caches) -> Capacity:
        avoid = {}
        for refs in caches.modelservers.values():
            for ref in refs:
                names_ = ref.spec.get("avoidColocationWith") or []
                avoid[group_of(ref.namespace, ref.name)] = frozenset(
                    group_of(ref.namespace, n) for n in names_
                )
        return build_capacity(
            caches.node_views(),
            caches.gpu_node_views(),
            self.expectations.overlay(caches.all_pods()),
            avoid,
        )

    def _hold_for_quota(self, key: ModelServerKey, plan: Plan, caches: Caches) -> Plan:
        """``plan`` without its creates while the quota that refused the last one still
        has no room for it; a quota change brings the next try (never a loop)."""
        wait = self._quota_waits.get(key)
        if wait is None:
            return plan
        if not plan.creates:  # nothing missing any more: nothing waits for quota
            del self._quota_waits[key]
            return plan
        refusal, seen = wait
        quota = caches.quota(key[0], refusal.quota)
        if quota != seen and (quota is None or quota.has_room(refusal)):
            return plan  # try again; a refusal with the new numbers holds it back again
        return replace(plan, creates=())

    def _wake_later(self, key: ModelServerKey, delay: float | None) -> None:
        """Reconcile ``key`` again in ``delay`` seconds (``None``: not on a timer)."""
        handle = self._wake_ups.pop(key, None)
        if handle is not None:
            handle.cancel()
        if delay is not None:
            # A little late rather than early: the run must find the delay passed.
            self._wake_ups[key] = asyncio.get_running_loop().call_later(
                delay + 0.05, self._wake, key
            )

    def _wake(self, key: ModelServerKey) -> None:
        self._wake_ups.pop(key, None)
        task = asyncio.ensure_future(self.runner.request(key))
        self._woken.add(task)
        task.add_done_callback(self._woken.discard)

    def _count_placements(self, plan: Plan) -> None:
        if plan.creates:
            self.metrics.placements.labels(result="placed").inc(len(plan.creates))
        if plan.unplaced:
            self.metrics.placements.labels(result="unschedulable").inc(len(plan.unplaced))

    def _track_capacity_wait(self, key: ModelServerKey, plan: Plan | None) -> None:
        if plan is not None and (plan.unplaced or plan.too_large):
            self._waiting_for_capacity.add(key)
        else:
            self._waiting_for_capacity.discard(key)

    async def _execute(
        self,
        ms: ModelServerRef,
        spec: ModelServerSpec,
        plan: Plan,
        pods: list[PodView],
        events: list[Event],
    ) -> tuple[list[PodView], Problem | None]:
        """Carry out ``plan``; the pods as they are now, and a refusal by the API, if any."""
        current = {p.name: p for p in pods}
        template = template_hash(spec)
        caches = self._caches
        bodies = [
            render_pod(
                ms,
                spec,
                replica=create.replica,
                placement=create.placement,
                template=template,
                runtime=self.runtime,
                kv_capacity=(self._kv_capacity(caches, spec, create.placement) if caches else None),
            )
            for create in plan.creates
        ]
        # Reserve the planned GPUs before the first await: a reconcile of another
        # ModelServer that runs while these calls are in flight must see them taken.
        planned = [pod_view(body) for body in bodies]
        for view in planned:
            if view is not None:
                self.expectations.created(view)
        try:
            for delete in plan.deletes:
                if await self.api.delete(pods_path(ms.namespace, delete.pod.name), delete.pod.uid):
                    self.expectations.deleted(delete.pod)
                    events.append(_delete_event(delete, plan))
                current[delete.pod.name] = replace(delete.pod, terminating=True)
            for create, body in zip(plan.creates, bodies, strict=True):
                name = body["metadata"]["name"]
                try:
                    created = await self.api.create(pods_path(ms.namespace), body)
                except ApiError as exc:
                    if exc.retriable:
                        raise
                    refusal = quota_refusal(name, exc.status, exc.message)
                    if refusal is not None:
                        # The other replicas would meet the same quota: stop here.
                        seen = caches.quota(ms.namespace, refusal.quota) if caches else None
                        self._quota_waits[ms.key] = (refusal, seen)
                        return list(current.values()), None
                    return list(current.values()), Problem(
                        "PodRejected", f"the API server refused pod {name}: {exc.message}"
                    )
                self._quota_waits.pop(ms.key, None)
                view = pod_view(created if created is not None else body)
                if view is None:
                    continue
                current[view.name] = view
                if created is None:  # made by an earlier run whose answer was lost
                    log.warning("pod %s/%s exists already; waiting to see it", ms.namespace, name)
                    continue
                self.expectations.created(view)
                events.append(_placed_event(create, view))
        finally:
            # Reservations of pods that were not created are released.
            for view in planned:
                if view is not None and view.name not in current:
                    self.expectations.forget_pod(view)
        return list(current.values()), None

    async def _ensure_service(self, ms: ModelServerRef, spec: ModelServerSpec) -> Problem | None:
        service = render_service(ms, spec)
        if self._services.get(ms.key) == service:
            return None
        path = services_path(ms.namespace, ms.name)
        if await self.api.create(services_path(ms.namespace), service) is None:
            existing = await self.api.get(path)
            owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
            if existing is not None and not any(o.get("uid") == ms.uid for o in owners):
                return Problem(
                    "ServiceNameTaken",
                    f"Service {ms.name} exists and does not belong to this ModelServer: delete "
                    "it, or recreate the ModelServer under another name",
                )
            # Ours, from before: bring it to what it should be.
            await self.api.merge_patch(
                path, {"metadata": service["metadata"], "spec": service["spec"]}
            )
        self._services[ms.key] = service
        return None

    def _scale_event(
        self, previous: Mapping[str, Any], spec: ModelServerSpec | None
    ) -> list[Event]:
        before = str(previous.get("ready", "")).partition("/")[2]
        if spec is None or not before.isdigit() or int(before) == spec.replicas:
            return []
        return [Event("Normal", "Scaled", f"replicas {before} -> {spec.replicas}")]

    async def _report_failure(self, key: ModelServerKey, error: Exception) -> None:
        """Every retry failed: say so in the status (best effort) and in an Event."""
        caches = self._caches
        ms = caches.modelserver(key) if caches is not None else None
        if ms is None:
            return
        problem = Problem("ReconcileError", f"{error}; retrying on the next change")
        self._emit(ms, Event("Warning", problem.reason, problem.message))
        self.metrics.set_phase(key, "Degraded")
        status = with_problem(ms.status, problem, ms.generation, _now())
        try:
            await self.api.merge_patch(
                modelserver_status_path(ms.namespace, ms.name), _status_patch(ms.status, status)
            )
        except ApiError as exc:
            log.error("cannot report the failure of %s/%s: %s", *key, exc)


def _placed_event(create: Create, pod: PodView) -> Event:
    gpus = ", ".join(create.placement.gpus)
    return Event(
        "Normal",
        "Placed",
        f"replica {create.replica}: pod {pod.name} on node {create.placement.node}, "
        f"GPU {gpus} ({format_bytes_human(pod.per_gpu_bytes)} per GPU)",
    )


def _delete_event(delete: Delete, plan: Plan) -> Event:
    pod = delete.pod
    if delete.reason == "ScaledDown":
        return Event("Normal", "ScaledDown", f"removed replica {pod.replica} (pod {pod.name})")
    if delete.reason == "RollingUpdate":
        rollout = plan.rollout
        progress = f" ({rollout.updated}/{rollout.desired} updated)" if rollout else ""
        return Event(
            "Normal",
            "RollingUpdate",
            f"replacing replica {pod.replica} (pod {pod.name}) with the current spec{progress}",
        )
    why = pod.failure or pod.message
    detail = f": {why}" if why else ""
    return Event(
        "Warning", "ReplicaFailed", f"pod {pod.name} {pod.phase.lower()}{detail}; replacing it"
    )
