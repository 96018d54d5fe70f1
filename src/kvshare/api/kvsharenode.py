"""The ``KVShareNode`` custom resource: one per GPU node, written by its node agent.

It is the node agent's published view of its GPUs and the KV pools on them. The
operator plans placements from it; ``kubectl get kvsharenodes`` shows it to people.
Memory fields are per GPU:

- ``total``: the device's memory; ``headroom``: kept back by the node agent;
- ``static``: static footprints (weights, activations, context) of the pools on it;
- ``kvMin``: guaranteed KV minimums committed to those pools;
- ``kvLease`` / ``kvMapped`` / ``kvUsed``: leases granted, physically mapped, holding blocks;
- ``free`` = total - headroom - static - kvMin: what placement may still commit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvshare.api.kube import ByteQuantity, Condition, KubeModel

__all__ = ["GpuStatus", "KVShareNodeSpec", "KVShareNodeStatus", "PoolStatus"]


class PoolStatus(KubeModel):
    """One worker's KV pool on a GPU."""

    namespace: str = Field(max_length=63)
    """Namespace of the pod."""
    pod: str = Field(max_length=253)
    """Pod name."""
    modelserver: str | None = Field(default=None, max_length=253)
    """ModelServer the pod serves, when it has one."""
    rank: int = Field(default=0, ge=0)
    """Tensor-parallel rank of the worker."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel size of the replica."""
    engine: str | None = Field(default=None, max_length=32)
    """Engine of the worker (vllm, sglang)."""
    priority: int = Field(default=100, ge=0, le=1000)
    """Reclaim priority."""
    static: ByteQuantity = 0
    """Static footprint of the worker."""
    kv_min: ByteQuantity = 0
    """Guaranteed KV bytes."""
    kv_max: ByteQuantity | None = None
    """KV cap, when set."""
    lease: ByteQuantity = 0
    """KV bytes the broker currently lets it map."""
    want: ByteQuantity = 0
    """KV bytes the worker asks for (at least its minimum, at most its max)."""
    mapped: ByteQuantity = 0
    """KV bytes physically mapped."""
    used: ByteQuantity = 0
    """KV bytes holding live blocks."""
    over_lease: bool = False
    """The device shows more memory for this pool than it may hold plus one page: what the
    broker charges it (lease and memory a reclaim asked back) within the reclaim's
    deadline, its lease after it."""
    policy: str = Field(default="", max_length=16)
    """Revision of the KV policy (min, max, priority) the pool runs under."""
    policy_refused: str = Field(default="", max_length=16)
    """Revision of the policy its pod's kvshare.io/kv-policy annotation asks for, when the
    node agent could not apply it in place (the pool keeps the one it runs)."""
    policy_message: str = Field(default="", max_length=512)
    """Why the pod's annotated policy is not applied."""


class GpuStatus(KubeModel):
    """Capacity and usage of one GPU."""

    uuid: str = Field(max_length=128)
    """GPU UUID (GPU-...)."""
    index: int = Field(ge=0)
    """Index on the node."""
    name: str = Field(default="", max_length=128)
    """Product name."""
    healthy: bool = True
    """Whether the device plugin reports the GPU healthy."""
    draining: bool = False
    """Draining GPUs accept no new pools and reclaim down to each pool's min."""
    total: ByteQuantity
    """Device memory."""
    headroom: ByteQuantity = 0
    """Memory the node agent keeps back from every budget."""
    static: ByteQuantity = 0
    """Sum of static footprints of the pools on this GPU."""
    kv_min: ByteQuantity = 0
    """Sum of guaranteed KV minimums."""
    kv_lease: ByteQuantity = 0
    """Sum of granted leases."""
    kv_mapped: ByteQuantity = 0
    """Sum of physically mapped KV bytes."""
    kv_used: ByteQuantity = 0
    """Sum of KV bytes holding live blocks."""
    free: ByteQuantity = 0
    """total - headroom - static - kvMin: what placement may still commit here."""
    slots: int = Field(default=0, ge=0)
    """kvshare.io/gpu slots this GPU advertises."""
    slots_used: int = Field(default=0, ge=0)
    """Slots allocated to containers."""
    pools: list[PoolStatus] = Field(default=[], max_length=256)
    """KV pools on this GPU."""


class KVShareNodeSpec(KubeModel):
    """Identifies the node; everything else is status."""

    node_name: str = Field(max_length=253)
    """Name of the Kubernetes Node this object describes."""


class KVShareNodeStatus(KubeModel):
    """The node agent's view of its GPUs, written at a bounded rate."""

    backend: Literal["cuda", "host"] = "cuda"
    """Virtual-memory backend of the pools (host = fake GPUs for tests and demos)."""
    agent_version: str = ""
    """kvshare version of the node agent."""
    observed_at: str | None = None
    """When the node agent last wrote this status (RFC 3339)."""
    gpu_count: int = Field(default=0, ge=0)
    """Number of GPUs, for `kubectl get`."""
    pool_count: int = Field(default=0, ge=0)
    """Number of KV pools across all GPUs, for `kubectl get`."""
    free: ByteQuantity = 0
    """Sum of the GPUs' free bytes, for `kubectl get`."""
    gpus: list[GpuStatus] = Field(default=[], max_length=64)
    """One entry per GPU."""
    node_config: str | None = Field(default=None, max_length=63)
    """The named node-agent configuration this node runs (chosen by its label)."""
    conditions: list[Condition] = Field(default=[], max_length=8)
    """NodeConfigApplied (False: the label names no configuration) and
    NvidiaDevicePluginConflict (True: NVIDIA's device plugin hands out these GPUs too)."""
