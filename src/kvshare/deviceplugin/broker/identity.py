"""Who a pool is, verified: the pod the node agent binds a connection to, and what that
pod was given.

Under Kubernetes a pool's hello is a claim, not an identity. The broker reads which pod
the connecting process runs in from its cgroup (:func:`~.peers.pod_of`), asks a
:class:`PodDirectory` what that pod is (its namespace, name and ModelServer from the pod
object the cluster side watches; the GPUs behind the ``kvshare.io/gpu`` slots its
containers got and its ``kvshare.io/gpu-memory`` request, from the kubelet), and admits
only what fits:

- the hello carries the pod's UID, and it is the UID of the pod the process runs in;
- the names it declares (namespace, pod, ModelServer) are the pod's, or left empty; the
  pool's record takes the pod's in any case;
- its GPU is one of the GPUs of the pod's slots;
- its static memory and minimum, with those of the pod's other pools, fit the pod's
  ``kvshare.io/gpu-memory`` request (what the scheduler and the namespace's quota
  counted for it);
- its priority is at most the ceiling an administrator granted the pod's namespace.

A start-up turn is checked the same way (its GPU, and its size against the request), and
a tensor-parallel group is the group of that pod only (:mod:`.turns` keys groups by the
verified pod). The broker knows nothing of Kubernetes: the directory is handed to it by
the node agent, which builds it from the pod watch and the kubelet's PodResources API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvshare.api.quantity import format_bytes_human
from kvshare.api.wire import Hello, TurnRequest
from kvshare.deviceplugin.broker.records import PoolRecord, align_up

__all__ = [
    "PodDirectory",
    "PodGrant",
    "Refusal",
    "check_hello",
    "check_pod_uid",
    "check_turn",
]


@dataclass(frozen=True)
class PodGrant:
    """A pod of this node as the cluster and the kubelet know it."""

    uid: str
    namespace: str
    name: str
    modelserver: str
    """Its ``kvshare.io/modelserver`` label ("" when it has none)."""
    gpus: frozenset[str]
    """UUIDs of the GPUs behind the ``kvshare.io/gpu`` slots its containers got."""
    memory_bytes: int
    """Its ``kvshare.io/gpu-memory`` request, in bytes (all containers)."""
    priority_ceiling: int = 1000
    """The highest KV priority its namespace may use."""

    @property
    def full_name(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


class PodDirectory(Protocol):
    """What the broker may ask about the pods of this node. Called from the broker's loop
    thread: answers must come from memory (a lookup it has to make is made elsewhere,
    and the broker is woken when it is done)."""

    def grant(self, uid: str) -> PodGrant | None:
        """The pod ``uid`` if it is known now; None: not (yet), look it up."""

    def unknown(self, uid: str) -> str:
        """Why pod ``uid`` is not known, for a refusal after waiting for it."""


class Refusal(NamedTuple):
    """Why a connection is refused: ``reason`` (a fixed label the metrics count by) and
    the message the peer gets."""

    reason: str
    message: str


def check_pod_uid(declared: str, actual: str, pid: int) -> Refusal | None:
    """The pod UID a hello or turn request declares must be the one of the pod process
    ``pid`` runs in (``actual``, from its cgroup)."""
    if not declared:
        return Refusal(
            "pod-uid",
            f"identity: the message carries no pod UID; process {pid} runs in pod {actual}: "
            "set KVSHARE_POD_UID from the downward API (metadata.uid)",
        )
    if declared != actual:
        return Refusal(
            "pod-uid",
            f"identity: the message names pod {declared}, but process {pid} runs in pod {actual}",
        )
    return None


def _names_refusal(hello: Hello, grant: PodGrant) -> Refusal | None:
    declared = (hello.namespace, hello.pod, hello.modelserver)
    actual = (grant.namespace, grant.name, grant.modelserver)
    fields = ("namespace", "pod", "modelserver")
    wrong = [
        f"{field} {mine!r} (the pod's is {theirs!r})"
        for field, mine, theirs in zip(fields, declared, actual, strict=True)
        if mine and mine != theirs
    ]
    if not wrong:
        return None
    return Refusal(
        "names",
        f"identity: the hello declares {', '.join(wrong)}; pools take the names of the pod "
        f"{grant.full_name} they run in",
    )


def _gpu_refusal(gpu: str, grant: PodGrant) -> Refusal | None:
    if gpu in grant.gpus:
        return None
    given = ", ".join(sorted(grant.gpus)) or "none"
    return Refusal(
        "gpu",
        f"allocation: GPU {gpu} is not one of the GPUs of pod {grant.full_name}'s "
        f"kvshare.io/gpu slots ({given})",
    )


def _memory_refusal(asked: int, others: int, grant: PodGrant) -> Refusal | None:
    if asked + others <= grant.memory_bytes:
        return None
    return Refusal(
        "memory",
        f"allocation: static + kv min {format_bytes_human(asked)} (with "
        f"{format_bytes_human(others)} of the pod's other pools) exceed pod "
        f"{grant.full_name}'s kvshare.io/gpu-memory request of "
        f"{format_bytes_human(grant.memory_bytes)}: lower kvCache.min or request more",
    )


def check_hello(
    hello: Hello, grant: PodGrant, pid: int, pools: Iterable[PoolRecord]
) -> Hello | Refusal:
    """The hello as the pool is admitted (the pod's names, a priority within its
    namespace's ceiling), or why it is refused. ``pools`` are the pools the pod holds
    (one this process re-declares is replaced, so it is not counted twice)."""
    refusal = _names_refusal(hello, grant) or _gpu_refusal(hello.gpu, grant)
    if refusal is not None:
        return refusal
    others = sum(
        p.static + p.kv_min
        for p in pools
        if not (p.pid == pid and p.hello.rank == hello.rank and p.gpu == hello.gpu)
    )
    asked = hello.static + align_up(hello.kv_min, max(hello.page_size, 1))
    refusal = _memory_refusal(asked, others, grant)
    if refusal is not None:
        return refusal
    return dataclasses.replace(
        hello,
        namespace=grant.namespace,
        pod=grant.name,
        modelserver=grant.modelserver,
        priority=min(hello.priority, grant.priority_ceiling),
    )


def check_turn(request: TurnRequest, grant: PodGrant) -> TurnRequest | Refusal:
    """The turn request as it is queued (with the pod's UID), or why it is refused: its
    GPU must be the pod's, its size within the pod's request."""
    refusal = _gpu_refusal(request.gpu, grant) or _memory_refusal(
        request.static + request.kv_min, 0, grant
    )
    if refusal is not None:
        return refusal
    return dataclasses.replace(request, pod_uid=grant.uid)
