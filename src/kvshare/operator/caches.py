"""What a reconcile reads of the cluster: kopf's watch-fed indexes, never the event that
triggered it (so a run with nothing to do makes no API call)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kvshare.operator.quota import QuotaView
from kvshare.operator.views import GpuNodeView, ModelServerKey, ModelServerRef, NodeView, PodView

__all__ = ["Caches"]


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
