"""Reconcile one ModelServer: read the caches, plan, act, write status, report.

:class:`Controller` is the only place where the pure parts (:mod:`.plan`,
:mod:`.render`, :mod:`.status`) meet the API. A reconcile is level-triggered and
idempotent: it reads the ModelServer and every relevant object from kopf's watch-fed
indexes (:class:`Caches`), never from the event that triggered it, so a run with nothing
to do makes no API call, and a restarted operator picks up where the last one stopped.
Runs of one ModelServer are serialized by a :class:`~.keyed.KeyedRunner`. Besides watch
events, one thing starts a run: the end of a failed replica's back-off (:mod:`.backoff`),
for which the controller keeps a timer per ModelServer on the event loop (:mod:`.wakeups`).

What it remembers between runs has modules of its own: the caches it reads
(:mod:`.caches`), what keeps a spec from being served (:mod:`.validation`), the
ModelServers held back by a quota (:mod:`.quota_holds`) or waiting for room
(:mod:`.capacity_waits`), and the KV-policy annotation written into pods
(:mod:`.kv_annotation`).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from kvshare.api.modelserver import ModelServerSpec
from kvshare.api.priorities import PriorityCeilings
from kvshare.api.quantity import format_bytes_human
from kvshare.operator.backoff import FailureBackoff, ReplicaFailures
from kvshare.operator.caches import Caches
from kvshare.operator.capacity_waits import CapacityWaits, cluster_capacity, kv_capacity
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
    refused_replicas,
    replica_policies,
    wanted_policy,
)
from kvshare.operator.keyed import KeyedRunner
from kvshare.operator.kv_annotation import KVAnnotations
from kvshare.operator.metrics import ModelServerSample, OperatorMetrics
from kvshare.operator.plan import Create, Delete, Plan, desired_replicas, plan_replicas
from kvshare.operator.quota import quota_refusal
from kvshare.operator.quota_holds import QuotaHolds
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
from kvshare.operator.validation import (
    cap_priority,
    missing_refs,
    names_in_colocation_rules,
    raw_replicas,
    validate_modelserver,
)
from kvshare.operator.views import ModelServerKey, ModelServerRef, NodeView, PodView, pod_view
from kvshare.operator.wakeups import WakeUps

__all__ = ["Controller", "EventSink"]

log = logging.getLogger(__name__)

#: Posts a Kubernetes Event about a ModelServer.
EventSink = Callable[[ModelServerRef, Event], None]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        *,
        ceilings: PriorityCeilings | None = None,
    ) -> None:
        self.api = api
        self.ceilings = ceilings or PriorityCeilings()
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
        self._capacity_waits = CapacityWaits()
        self._annotations = KVAnnotations()
        self._quota_holds = QuotaHolds()
        self._wake_ups = WakeUps(self.runner.request)

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
        self._capacity_waits.forget(key)
        self._quota_holds.forget(key)
        self._annotations.forget(key)
        self.backoff.forget(key)
        self._wake_ups.later(key, None)
        self.metrics.forget(key)
        log.info("forgot ModelServer %s/%s", *key)

    def close(self) -> None:
        """The operator stops: drop the reconciles due later."""
        self._wake_ups.close()

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
                    and name in names_in_colocation_rules(ref)
                )
        return keys

    def affected_by_pod(
        self, event: str, namespace: str | None, modelserver: str | None
    ) -> set[ModelServerKey]:
        """ModelServers a pod event matters to: its own, and when the pod is gone (its
        GPU room is free again) those waiting for capacity."""
        keys = {(namespace, modelserver)} if namespace and modelserver else set()
        if event == "DELETED":
            keys |= self._capacity_waits.waiting()
        return keys

    def affected_by_gpu_node(self, node: str, caches: Caches) -> set[ModelServerKey]:
        """ModelServers a KVShareNode change matters to: those with pods on the node
        (their KV usage) and those waiting for capacity."""
        return set(caches.pods_by_node.get(node, ())) | self._capacity_waits.waiting()

    def affected_by_quota(self, namespace: str | None, name: str) -> set[ModelServerKey]:
        """ModelServers a ResourceQuota change matters to: those refused by it."""
        return self._quota_holds.affected(namespace, name)

    def affected_by_node(self, view: NodeView) -> set[ModelServerKey]:
        """ModelServers a Node change matters to: those waiting for capacity, and only
        when what placement reads (labels, taints, cordon) changed."""
        return self._capacity_waits.node_changed(view)

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
        spec, problem = validate_modelserver(ms)
        capped: str | None = None
        if spec is not None:
            spec, capped = cap_priority(ms, spec, self.ceilings)
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
                lambda: cluster_capacity(caches, self.expectations),
                failures.held,
                refused_replicas(replica_policies(pods, pools, wanted)),
            )
            plan = self._quota_holds.hold(ms.key, plan, caches)
            self._count_placements(plan)
            pods, problem = await self._execute(ms, spec, plan, pods, events)
            problem = await self._ensure_service(ms, spec) or problem
            await self._annotations.annotate(self.api, ms, pods, wanted, events)
            policies = replica_policies(pods, pools, wanted)
        refused = self._quota_holds.refusal(ms.key)
        observation = Observation(
            generation=ms.generation,
            desired=spec.replicas if spec is not None else raw_replicas(ms),
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
            missing_refs=missing_refs(ms, spec, caches) if spec is not None else None,
            priority_capped=capped,
        )
        status = compute_status(observation, previous, _now())
        self._capacity_waits.track(ms.key, plan)
        self._wake_ups.later(ms.key, failures.wake_in)
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

    def _count_placements(self, plan: Plan) -> None:
        if plan.creates:
            self.metrics.placements.labels(result="placed").inc(len(plan.creates))
        if plan.unplaced:
            self.metrics.placements.labels(result="unschedulable").inc(len(plan.unplaced))

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
                kv_capacity=(kv_capacity(caches, spec, create.placement) if caches else None),
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
                        self._quota_holds.refused(ms.key, refusal, seen)
                        return list(current.values()), None
                    return list(current.values()), Problem(
                        "PodRejected", f"the API server refused pod {name}: {exc.message}"
                    )
                self._quota_holds.created(ms.key)
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
