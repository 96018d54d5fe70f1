"""Placement: which node and which GPUs each replica runs on.

One function serves two programs: the operator places ModelServer replicas onto nodes
and GPUs, and the node agent's device plugin picks slots on distinct GPUs. It is pure
and deterministic: the same replicas and nodes give the same placements, whatever order
they are listed in.

Rules
-----
- A replica with tensor-parallel size ``k`` takes ``k`` distinct GPUs of one node; on
  each it needs ``per_gpu_bytes`` (static footprint + KV minimum) of free memory and
  one free slot. A GPU is never over-committed in memory or slots.
- Nodes must be schedulable, carry every ``node_selector`` label, and have every
  ``NoSchedule``/``NoExecute`` taint tolerated. Unhealthy or draining GPUs take nothing.
- ``avoid`` is hard and symmetric: a replica never shares a GPU with a group it avoids,
  nor with a replica whose group avoids it.
  ``colocate_with`` is soft: GPUs hosting a preferred group are chosen when they fit.
- Policies. A node's *room* for a TP=k replica is its k-th largest free GPU (it fits
  iff that is at least the replica's bytes per GPU). ``binpack`` (default) takes the node
  with the least room that fits, the fullest node among equals (least free memory over
  its usable GPUs), then its tightest GPUs; ``spread`` takes the node with the most room
  and free memory, then its emptiest GPUs. Remaining ties go to the node name and GPU
  index.
- Stable: a replica with a ``current`` placement keeps it (committed first, never moved).
- New replicas are placed largest first (TP size, then bytes per GPU, then key), which
  packs better than arrival order and makes the result independent of input order.

Contract: ``GpuState.free_bytes`` / ``free_slots`` describe what is *not* committed to any
replica in the request list; current placements in the list are subtracted here.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvshare.api.quantity import format_bytes, format_bytes_human

__all__ = [
    "GpuState",
    "NodeState",
    "Placement",
    "Planner",
    "ReplicaRequest",
    "Taint",
    "Tolerance",
    "Unplaced",
    "place",
]

Policy = Literal["binpack", "spread"]
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Taint:
    """A node taint."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class Tolerance:
    """A toleration: ``operator`` is ``Exists`` or ``Equal``; empty key/effect match all."""

    key: str = ""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        """Whether this toleration covers ``taint``."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True)
class GpuState:
    """One GPU as placement sees it."""

    uuid: str
    index: int
    free_bytes: int
    free_slots: int
    healthy: bool = True
    draining: bool = False
    #: Groups (e.g. ``namespace/modelserver``) with a replica on this GPU, for co-location.
    tenants: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NodeState:
    """One node: its GPUs, labels, taints, and whether it takes new work."""

    name: str
    gpus: tuple[GpuState, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    schedulable: bool = True


@dataclass(frozen=True)
class Placement:
    """A node and the UUIDs of the replica's GPUs in rank order."""

    node: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Unplaced:
    """Why a replica could not be placed, in words a user can act on."""

    reason: str


@dataclass(frozen=True)
class ReplicaRequest:
    """One replica to place (or to keep where it is, when ``current`` is set)."""

    key: str
    group: str
    per_gpu_bytes: int
    tp: int = 1
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Tolerance, ...] = ()
    colocate_with: frozenset[str] = frozenset()
    avoid: frozenset[str] = frozenset()
    policy: Policy = "binpack"
    current: Placement | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"replica {self.key}: tensor-parallel size must be >= 1")
        if self.per_gpu_bytes < 0:
            raise ValueError(f"replica {self.key}: bytes per GPU must be >= 0")


class _GpuRoom:
    """Mutable remaining capacity of one GPU while a plan is being made."""

    __slots__ = (
        "draining",
        "free_bytes",
        "free_slots",
        "healthy",
        "index",
        "repels",
        "tenants",
        "uuid",
    )

    def __init__(self, gpu: GpuState) -> None:
        self.uuid = gpu.uuid
        self.index = gpu.index
        self.free_bytes = gpu.free_bytes
        self.free_slots = gpu.free_slots
        self.healthy = gpu.healthy
        self.draining = gpu.draining
        self.tenants: Counter[str] = Counter(gpu.tenants)
        # Groups that a tenant of this GPU avoids: they may not join it.
        self.repels: Counter[str] = Counter()

    def usable(self) -> bool:
        return self.healthy and not self.draining and self.free_slots > 0


class _NodeRoom:
    """Mutable remaining capacity of one node, with its per-shape index keys."""

    __slots__ = ("gpus", "keys", "name", "node_class")

    def __init__(self, node: NodeState, node_class: _NodeClass) -> None:
        self.name = node.name
        self.node_class = node_class
        self.gpus = {gpu.uuid: _GpuRoom(gpu) for gpu in sorted(node.gpus, key=lambda g: g.index)}
        self.keys: dict[int, tuple[int, int]] = {}  # tp -> (room, free) as last indexed

    def kth_largest_free(self, k: int) -> int:
        """Room for a TP=k replica: the k-th largest free GPU, or -1 without k usable GPUs."""
        frees = sorted((g.free_bytes for g in self.gpus.values() if g.usable()), reverse=True)
        return frees[k - 1] if len(frees) >= k else -1

    def index_key(self, k: int) -> tuple[int, int]:
        """(room for TP=k, free bytes over usable GPUs): the order both policies walk."""
        free = sum(max(g.free_bytes, 0) for g in self.gpus.values() if g.usable())
        return self.kth_largest_free(k), free


class _NodeClass:
    """Nodes with the same labels, taints and schedulability, indexed per TP shape."""

    __slots__ = ("by_shape", "labels", "nodes", "schedulable", "taints")

    def __init__(self, node: NodeState) -> None:
        self.labels = dict(node.labels)
        self.taints = node.taints
        self.schedulable = node.schedulable
        self.nodes: list[_NodeRoom] = []
        # tp -> sorted [(room, free, node name)]; built on first use.
        self.by_shape: dict[int, list[tuple[int, int, str]]] = {}

    def admits(self, replica: ReplicaRequest) -> bool:
        if not self.schedulable:
            return False
        if any(self.labels.get(k) != v for k, v in replica.node_selector.items()):
            return False
        return all(
            any(t.tolerates(taint) for t in replica.tolerations)
            for taint in self.taints
            if taint.effect in _BLOCKING_EFFECTS
        )

    def shape_index(self, tp: int) -> list[tuple[int, int, str]]:
        index = self.by_shape.get(tp)
        if index is None:
            for node in self.nodes:
                node.keys[tp] = node.index_key(tp)
            index = sorted((*node.keys[tp], node.name) for node in self.nodes)
            self.by_shape[tp] = index
        return index


def _size(num_bytes: int) -> str:
    exact = format_bytes(num_bytes)
    return exact if len(exact) <= 6 else format_bytes_human(num_bytes)


class Planner:
    """Incremental placement over a set of nodes; :func:`place` is the one-shot form.

    Each committed replica reduces the free memory and slots of its GPUs. The per-class,
    per-shape sorted indexes make each placement O(log nodes) plus the index update.
    """

    def __init__(self, nodes: Iterable[NodeState]) -> None:
        self._nodes: dict[str, _NodeRoom] = {}
        # Insertion-ordered, and nodes arrive sorted by name: the class order is stable.
        classes: dict[tuple[object, ...], _NodeClass] = {}
        for node in sorted(nodes, key=lambda n: n.name):
            if node.name in self._nodes:
                raise ValueError(f"node {node.name} is listed twice")
            signature = (tuple(sorted(node.labels.items())), node.taints, node.schedulable)
            node_class = classes.get(signature)
            if node_class is None:
                node_class = classes[signature] = _NodeClass(node)
            room = _NodeRoom(node, node_class)
            node_class.nodes.append(room)
            self._nodes[node.name] = room
        self._classes = list(classes.values())
        # group -> nodes hosting one of its replicas, for colocateWith preferences.
        self._group_nodes: dict[str, set[str]] = {}
        for room in self._nodes.values():
            for gpu in room.gpus.values():
                for group in gpu.tenants:
                    self._group_nodes.setdefault(group, set()).add(room.name)
        self._admitting: dict[tuple[object, ...], list[_NodeClass]] = {}

    # --- committing ---------------------------------------------------------------

    def commit(self, replica: ReplicaRequest, placement: Placement) -> None:
        """Record that ``replica`` runs at ``placement`` (its GPUs lose memory and a slot).

        A placement on an unknown node or GPU is recorded as nothing: the replica keeps
        running there, but it consumes nothing this planner can see.
        """
        node = self._nodes.get(placement.node)
        if node is None:
            return
        for uuid in placement.gpus:
            gpu = node.gpus.get(uuid)
            if gpu is not None:
                gpu.free_bytes -= replica.per_gpu_bytes
                gpu.free_slots -= 1
                gpu.tenants[replica.group] += 1
                gpu.repels.update(replica.avoid)
        self._group_nodes.setdefault(replica.group, set()).add(node.name)
        self._reindex(node)

    def _reindex(self, node: _NodeRoom) -> None:
        for tp, index in node.node_class.by_shape.items():
            del index[bisect.bisect_left(index, (*node.keys[tp], node.name))]
            node.keys[tp] = node.index_key(tp)
            bisect.insort(index, (*node.keys[tp], node.name))

    # --- placing --------------------------------------------------------------------

    def place(self, replica: ReplicaRequest) -> Placement | Unplaced:
        """Choose a node and GPUs for ``replica`` and commit them, or say why not."""
        classes = self._admitting_classes(replica)
        if not classes:
            return Unplaced(self._no_matching_node(replica))
        chosen = self._choose_colocated(replica, classes) if replica.colocate_with else None
        if chosen is None:
            chosen = self._choose(replica, classes)
        if chosen is None:
            return Unplaced(self._no_room(replica, classes))
        self.commit(replica, chosen)
        return chosen

    def _admitting_classes(self, replica: ReplicaRequest) -> list[_NodeClass]:
        cache_key = (tuple(sorted(replica.node_selector.items())), replica.tolerations)
        classes = self._admitting.get(cache_key)
        if classes is None:
            classes = [c for c in self._classes if c.admits(replica)]
            self._admitting[cache_key] = classes
        return classes

    def _choose_colocated(
        self, replica: ReplicaRequest, classes: list[_NodeClass]
    ) -> Placement | None:
        """The best node already hosting a preferred group, on GPUs shared with it."""
        admitted = {id(c) for c in classes}
        hosts = set().union(*(self._group_nodes.get(g, ()) for g in replica.colocate_with))
        ranked = []
        for name in hosts:
            node = self._nodes[name]
            if id(node.node_class) not in admitted:
                continue
            room, free = node.index_key(replica.tp)
            if room >= replica.per_gpu_bytes:
                ranked.append((_rank(replica.policy, room, free, name), node))
        for _, node in sorted(ranked, key=lambda item: item[0]):
            gpus = self._pick_gpus(node, replica, require_colocation=True)
            if gpus is not None:
                return Placement(node.name, gpus)
        return None

    def _choose(self, replica: ReplicaRequest, classes: list[_NodeClass]) -> Placement | None:
        """Walk each class's index from the best end and return the first node that fits."""
        best: tuple[tuple[int, int, str], Placement] | None = None
        for node_class in classes:
            index = node_class.shape_index(replica.tp)
            start = bisect.bisect_left(index, (replica.per_gpu_bytes,))
            if start == len(index):
                continue
            found = self._first_fit(replica, index, start)
            if found is None:
                continue
            rank, placement = found
            if best is None or rank < best[0]:
                best = (rank, placement)
        return best[1] if best else None

    def _first_fit(
        self, replica: ReplicaRequest, index: list[tuple[int, int, str]], start: int
    ) -> tuple[tuple[int, int, str], Placement] | None:
        if replica.policy == "binpack":
            positions: Iterable[int] = range(start, len(index))
        else:
            positions = _spread_order(index, start)
        for position in positions:
            room, free, name = index[position]
            gpus = self._pick_gpus(self._nodes[name], replica, require_colocation=False)
            if gpus is not None:
                return _rank(replica.policy, room, free, name), Placement(name, gpus)
        return None

    def _pick_gpus(
        self, node: _NodeRoom, replica: ReplicaRequest, *, require_colocation: bool
    ) -> tuple[str, ...] | None:
        """The replica's GPUs on ``node``: shared with a preferred group first, then the
        tightest (binpack) or emptiest (spread); ``None`` when fewer than ``tp`` fit."""
        candidates = [
            gpu
            for gpu in node.gpus.values()
            if gpu.usable()
            and gpu.free_bytes >= replica.per_gpu_bytes
            and not any(gpu.tenants[group] for group in replica.avoid)
            and not gpu.repels[replica.group]
        ]
        if len(candidates) < replica.tp:
            return None

        direction = 1 if replica.policy == "binpack" else -1
        if replica.colocate_with:

            def colocated(gpu: _GpuRoom) -> bool:
                return any(gpu.tenants[group] for group in replica.colocate_with)

            candidates.sort(key=lambda g: (not colocated(g), direction * g.free_bytes, g.index))
            if require_colocation and not colocated(candidates[0]):
                return None
        else:
            candidates.sort(key=lambda g: (direction * g.free_bytes, g.index))
        chosen = candidates[: replica.tp]
        return tuple(g.uuid for g in sorted(chosen, key=lambda g: g.index))

    # --- explaining -----------------------------------------------------------------

    def _no_matching_node(self, replica: ReplicaRequest) -> str:
        if not self._nodes:
            return "no GPU nodes are known (is the kvshare node agent running?)"
        # Each class is counted under the first check it fails.
        cordoned = by_selector = tainted = 0
        for node_class in self._classes:
            if not node_class.schedulable:
                cordoned += len(node_class.nodes)
            elif any(node_class.labels.get(k) != v for k, v in replica.node_selector.items()):
                by_selector += len(node_class.nodes)
            else:
                tainted += len(node_class.nodes)
        parts = []
        if cordoned:
            parts.append(f"{cordoned} cordoned")
        if by_selector:
            selector = ",".join(f"{k}={v}" for k, v in sorted(replica.node_selector.items()))
            parts.append(f"{by_selector} not matching nodeSelector {selector}")
        if tainted:
            parts.append(f"{tainted} with taints the replica does not tolerate")
        return f"no node is eligible ({len(self._nodes)} nodes: {'; '.join(parts)})"

    def _no_room(self, replica: ReplicaRequest, classes: list[_NodeClass]) -> str:
        gpus = "1 GPU" if replica.tp == 1 else f"{replica.tp} GPUs"
        best_key, best_node = -1, ""
        for node_class in classes:
            for node in node_class.nodes:
                key = node.kth_largest_free(replica.tp)
                if key > best_key or (key == best_key and node.name < best_node):
                    best_key, best_node = key, node.name
        need = f"{_size(replica.per_gpu_bytes)} free and a free slot"
        if replica.avoid:
            need += f", not shared with {', '.join(sorted(replica.avoid))}"
        if best_key < 0:
            largest = f"no node has {gpus} that are healthy with a free slot"
            return f"no node has {gpus} with {need} ({largest})"
        return f"no node has {gpus} with {need} (largest: {_size(best_key)} on {best_node})"


def _rank(policy: Policy, room: int, free: int, name: str) -> tuple[int, int, str]:
    """Smaller is better: least room first for binpack, most room first for spread."""
    return (room, free, name) if policy == "binpack" else (-room, -free, name)


def _spread_order(index: list[tuple[int, int, str]], start: int) -> Iterable[int]:
    """Positions from the most room down to ``start``; equal (room, free) in name order."""
    end = len(index)
    while end > start:
        room, free, _ = index[end - 1]
        first = max(bisect.bisect_left(index, (room, free)), start)
        yield from range(first, end)
        end = first


def place(
    replicas: Sequence[ReplicaRequest], nodes: Sequence[NodeState]
) -> dict[str, Placement | Unplaced]:
    """Place every replica; replicas with a ``current`` placement keep it.

    Returns a placement or an :class:`Unplaced` reason for every replica key.
    """
    keys = [r.key for r in replicas]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"replica {duplicate} is listed twice")
    planner = Planner(nodes)
    result: dict[str, Placement | Unplaced] = {}
    for replica in sorted((r for r in replicas if r.current), key=lambda r: r.key):
        assert replica.current is not None
        planner.commit(replica, replica.current)
        result[replica.key] = replica.current
    pending = sorted(
        (r for r in replicas if not r.current), key=lambda r: (-r.tp, -r.per_gpu_bytes, r.key)
    )
    for replica in pending:
        result[replica.key] = planner.place(replica)
    return result
