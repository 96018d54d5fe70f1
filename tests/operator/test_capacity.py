"""Capacity: what KVShareNodes report and the operator's own pods combine, each pod
counted exactly once, whether or not the node agent reports it yet."""

from __future__ import annotations

from kvshare.api.kvsharenode import GpuStatus, KVShareNodeStatus, PoolStatus
from kvshare.api.placement import Placement, ReplicaRequest, Unplaced, place
from kvshare.operator.capacity import build_capacity
from kvshare.operator.views import GpuNodeView, NodeView
from tests.operator.specs import GIB, pod

NODE = NodeView("node-a", {"zone": "a"}, (), True)


def gpu(uuid: str, index: int, pools: list[PoolStatus], total: int = 80 * GIB) -> GpuStatus:
    static = sum(p.static for p in pools)
    kv_min = sum(p.kv_min for p in pools)
    return GpuStatus(
        uuid=uuid,
        index=index,
        total=total,
        headroom=2 * GIB,
        static=static,
        kv_min=kv_min,
        free=total - 2 * GIB - static - kv_min,
        slots=4,
        slots_used=len(pools),
        pools=pools,
    )


def pool(pod_name: str, ms: str = "qwen", rank: int = 0, namespace: str = "llm") -> PoolStatus:
    return PoolStatus(
        namespace=namespace,
        pod=pod_name,
        modelserver=ms,
        rank=rank,
        static=18 * GIB,
        kv_min=4 * GIB,
    )


def gpu_node(*gpus: GpuStatus, node: str = "node-a") -> GpuNodeView:
    return GpuNodeView(node, KVShareNodeStatus(gpus=list(gpus)))


def free_after_current(capacity_nodes: object, current: dict[str, ReplicaRequest]) -> int:
    """Room left on GPU-a0 for a probe replica, after every current replica is committed."""
    probe = ReplicaRequest(key="probe", group="probe", per_gpu_bytes=200 * GIB)
    result = place([*current.values(), probe], capacity_nodes)  # type: ignore[arg-type]
    outcome = result["probe"]
    assert isinstance(outcome, Unplaced)
    return int(outcome.reason.split("largest: ")[1].split("Gi")[0])


def test_a_pod_the_node_agent_reports_is_counted_once() -> None:
    reported = gpu_node(gpu("GPU-a0", 0, [pool("qwen-0")]))
    capacity = build_capacity({"node-a": NODE}, [reported], [pod(0)], {})
    (state,) = capacity.nodes
    # The reported pool is added back, and the pod is a current placement instead.
    assert state.gpus[0].free_bytes == 78 * GIB
    assert state.gpus[0].free_slots == 4
    assert free_after_current(capacity.nodes, dict(capacity.current)) == 56


def test_a_planned_pod_not_yet_reported_is_counted() -> None:
    empty = gpu_node(gpu("GPU-a0", 0, []))
    capacity = build_capacity({"node-a": NODE}, [empty], [pod(0)], {})
    assert capacity.current["llm/qwen-0"].current == Placement("node-a", ("GPU-a0",))
    assert free_after_current(capacity.nodes, dict(capacity.current)) == 56


def test_pools_of_pods_the_operator_does_not_know_stay_and_are_tenants() -> None:
    foreign = gpu_node(gpu("GPU-a0", 0, [pool("notebook", ms="other", namespace="lab")]))
    capacity = build_capacity({"node-a": NODE}, [foreign], [], {})
    (state,) = capacity.nodes
    assert state.gpus[0].free_bytes == 56 * GIB
    assert state.gpus[0].free_slots == 3
    assert state.gpus[0].tenants == frozenset({"lab/other"})
    assert capacity.current == {}


def test_reported_gpus_win_over_the_planned_ones() -> None:
    # Planned on GPU-a0, but the device plugin handed out GPU-a1.
    reported = gpu_node(gpu("GPU-a0", 0, []), gpu("GPU-a1", 1, [pool("qwen-0")]))
    capacity = build_capacity({"node-a": NODE}, [reported], [pod(0, gpus=("GPU-a0",))], {})
    assert capacity.current["llm/qwen-0"].current == Placement("node-a", ("GPU-a1",))


def test_finished_pods_hold_nothing_and_avoid_rules_follow_the_group() -> None:
    empty = gpu_node(gpu("GPU-a0", 0, []))
    pods = [pod(0, phase="Failed"), pod(1)]
    capacity = build_capacity({"node-a": NODE}, [empty], pods, {"llm/qwen": frozenset({"llm/x"})})
    assert list(capacity.current) == ["llm/qwen-1"]
    assert capacity.current["llm/qwen-1"].avoid == frozenset({"llm/x"})


def test_a_kvsharenode_without_its_node_object_is_left_out() -> None:
    orphan = gpu_node(gpu("GPU-z0", 0, []), node="node-z")
    capacity = build_capacity({"node-a": NODE}, [orphan], [], {})
    assert capacity.nodes == ()
    assert capacity.too_small_for(500 * GIB, 1) is None  # nothing known: placement says so


def test_too_small_names_the_largest_gpu_and_the_widest_node() -> None:
    small = gpu_node(gpu("GPU-a0", 0, [], total=40 * GIB), gpu("GPU-a1", 1, [], total=48 * GIB))
    capacity = build_capacity({"node-a": NODE}, [small], [], {})
    assert capacity.too_small_for(46 * GIB, 1) is None
    message = capacity.too_small_for(47 * GIB, 1)
    assert message is not None
    assert "47.0Gi" in message and "46.0Gi" in message and "node-a" in message
    assert "raise tensorParallelSize" in (message or "")
    message = capacity.too_small_for(10 * GIB, 4)
    assert message == (
        "a replica needs 4 GPUs on one node but the node with the most has 2 (node-a): "
        "lower tensorParallelSize"
    )
