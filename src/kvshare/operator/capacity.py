"""The cluster's GPU capacity as placement sees it, from KVShareNodes, Nodes and pods.

Two sources describe what runs on a GPU, and they overlap:

- a KVShareNode reports every KV pool on each GPU (``free`` already has their static
  footprint and KV minimum taken out), but only once the engine has started;
- the operator's own pods carry their planned node, GPUs and bytes per GPU from the
  moment they are created, long before their pools appear.

:func:`build_capacity` adds the pools of the pods it knows back to each GPU's ``free`` and
lists those pods as *current* placements instead, so each known pod counts exactly once
(the contract of :func:`kvshare.api.placement.place`). Pools of pods it does not know (a
deleted ModelServer's pods still stopping, user-made pods with the runtime injected) stay
subtracted, and their groups stay tenants of the GPU for co-location rules.

Slots are counted the same way for pools; a known pod that holds its slots but has no
pool yet is counted twice for slots (never for memory) until its pool appears. That errs
towards "no free slot" for the minutes an engine takes to start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvshare.api.placement import GpuState, NodeState, Placement, ReplicaRequest
from kvshare.api.quantity import format_bytes_human
from kvshare.operator.views import GpuNodeView, NodeView, PodView

__all__ = ["Capacity", "build_capacity", "group_of", "replica_key"]


def group_of(namespace: str, modelserver: str) -> str:
    """The placement group of a ModelServer's replicas (co-location rules name groups)."""
    return f"{namespace}/{modelserver}"


def replica_key(namespace: str, pod: str) -> str:
    """The placement key of one replica: its pod."""
    return f"{namespace}/{pod}"


@dataclass(frozen=True)
class Capacity:
    """Placement's input: nodes with what is still free, and the replicas already there."""

    nodes: tuple[NodeState, ...]
    current: Mapping[str, ReplicaRequest] = field(default_factory=dict)
    """Known pods as replicas with a current placement, by placement key."""
    largest_gpu: tuple[int, str] | None = None
    """Usable bytes (total - headroom) of the largest healthy GPU, and its node."""
    most_gpus: tuple[int, str] | None = None
    """Healthy GPUs of the node that has the most, and its name."""

    def too_small_for(self, per_gpu_bytes: int, tp: int) -> str | None:
        """Why no GPU of this cluster could ever hold such a replica, or ``None``."""
        if self.largest_gpu is None or self.most_gpus is None:
            return None  # no GPUs known at all: placement says so itself
        gpus, gpus_node = self.most_gpus
        if tp > gpus:
            return (
                f"a replica needs {tp} GPUs on one node but the node with the most has {gpus} "
                f"({gpus_node}): lower tensorParallelSize"
            )
        usable, usable_node = self.largest_gpu
        if per_gpu_bytes > usable:
            return (
                f"each worker needs {format_bytes_human(per_gpu_bytes)} (static memory plus "
                f"kvCache.min) but the largest GPU offers {format_bytes_human(usable)} "
                f"({usable_node}): raise tensorParallelSize to split the weights, or lower "
                "staticMemory or kvCache.min"
            )
        return None


def build_capacity(
    nodes: Mapping[str, NodeView],
    gpu_nodes: Iterable[GpuNodeView],
    pods: Iterable[PodView],
    avoid: Mapping[str, frozenset[str]],
) -> Capacity:
    """Capacity from the cluster's views.

    ``pods`` are the live replica pods of every ModelServer (the operator's own, including
    those it created but has not seen yet); ``avoid`` maps a group to the groups it
    avoids. A KVShareNode without a Node object is left out: nothing can be pinned there.
    """
    known = {(p.namespace, p.name): p for p in pods if not p.finished}
    gpu_nodes = [g for g in gpu_nodes if g.node in nodes]

    # Where each known pod really runs, by rank, when its pools are reported.
    actual: dict[tuple[str, str], dict[int, str]] = {}
    for gpu_node in gpu_nodes:
        for gpu in gpu_node.status.gpus:
            for pool in gpu.pools:
                if (pool.namespace, pool.pod) in known:
                    actual.setdefault((pool.namespace, pool.pod), {})[pool.rank] = gpu.uuid

    states = []
    largest: tuple[int, str] | None = None
    most: tuple[int, str] | None = None
    for gpu_node in sorted(gpu_nodes, key=lambda g: g.node):
        view = nodes[gpu_node.node]
        gpus = []
        healthy = 0
        for gpu in gpu_node.status.gpus:
            mine = [p for p in gpu.pools if (p.namespace, p.pod) in known]
            others = [p for p in gpu.pools if (p.namespace, p.pod) not in known]
            gpus.append(
                GpuState(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    free_bytes=gpu.free + sum(p.static + p.kv_min for p in mine),
                    free_slots=max(0, gpu.slots - gpu.slots_used + len(mine)),
                    healthy=gpu.healthy,
                    draining=gpu.draining,
                    tenants=frozenset(
                        group_of(p.namespace, p.modelserver) for p in others if p.modelserver
                    ),
                )
            )
            if gpu.healthy:
                healthy += 1
                usable = gpu.total - gpu.headroom
                if largest is None or usable > largest[0]:
                    largest = (usable, gpu_node.node)
        if healthy and (most is None or healthy > most[0]):
            most = (healthy, gpu_node.node)
        states.append(
            NodeState(
                name=gpu_node.node,
                gpus=tuple(gpus),
                labels=view.labels,
                taints=view.taints,
                schedulable=view.schedulable,
            )
        )

    current = {}
    for (namespace, name), pod in known.items():
        ranks = actual.get((namespace, name), {})
        where = pod.gpus
        if len(ranks) == len(pod.gpus) and ranks:
            where = tuple(ranks[rank] for rank in sorted(ranks))
        group = group_of(namespace, pod.modelserver)
        request = ReplicaRequest(
            key=replica_key(namespace, name),
            group=group,
            per_gpu_bytes=pod.per_gpu_bytes,
            tp=max(1, len(where)),
            avoid=avoid.get(group, frozenset()),
            current=Placement(pod.node, where),
        )
        current[request.key] = request
    return Capacity(tuple(states), current, largest, most)
