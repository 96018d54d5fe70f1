"""Capacity as a reconcile sees it: the room in the cluster now (:func:`cluster_capacity`,
from the caches and the pods the controller expects), the most a replica's GPUs could
ever lend its KV cache (:func:`kv_capacity`), and the ModelServers waiting for room
(:class:`CapacityWaits`), which a freed GPU or a changed Node brings back."""

from __future__ import annotations

from kvshare.api.modelserver import ModelServerSpec
from kvshare.api.placement import Placement
from kvshare.operator.caches import Caches
from kvshare.operator.capacity import Capacity, build_capacity, group_of
from kvshare.operator.expectations import Expectations
from kvshare.operator.plan import Plan
from kvshare.operator.views import ModelServerKey, NodeView

__all__ = ["CapacityWaits", "cluster_capacity", "kv_capacity"]


def cluster_capacity(caches: Caches, expectations: Expectations) -> Capacity:
    """The cluster's GPUs as placement sees them, with the pods the controller has just
    created or deleted counted as the watch will show them."""
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
        expectations.overlay(caches.all_pods()),
        avoid,
    )


def kv_capacity(caches: Caches, spec: ModelServerSpec, placement: Placement) -> int | None:
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


class CapacityWaits:
    """The ModelServers with replicas no GPU has room for, and the Nodes as placement
    last read them. Touched on the event loop's thread only."""

    def __init__(self) -> None:
        self._waiting: set[ModelServerKey] = set()
        self._node_views: dict[str, NodeView] = {}

    def track(self, key: ModelServerKey, plan: Plan | None) -> None:
        """After a reconcile of ``key`` that planned ``plan``."""
        if plan is not None and (plan.unplaced or plan.too_large):
            self._waiting.add(key)
        else:
            self._waiting.discard(key)

    def waiting(self) -> set[ModelServerKey]:
        """The ModelServers waiting for room."""
        return set(self._waiting)

    def node_changed(self, view: NodeView) -> set[ModelServerKey]:
        """Those waiting for room, when what placement reads of a Node (labels, taints,
        cordon) changed; none otherwise."""
        if self._node_views.get(view.name) == view:
            return set()
        self._node_views[view.name] = view
        return set(self._waiting)

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` was deleted."""
        self._waiting.discard(key)
