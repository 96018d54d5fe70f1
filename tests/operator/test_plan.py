"""Planning one ModelServer's replicas: creates, scale-down order, replacements, and a
rolling update that never has more than one replica in flight."""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.api.kvsharenode import GpuStatus, KVShareNodeStatus
from kvshare.api.placement import Placement
from kvshare.operator.capacity import Capacity, build_capacity
from kvshare.operator.plan import Desired, Plan, plan_replicas
from kvshare.operator.views import GpuNodeView, NodeView, PodView
from tests.operator.specs import GIB, pod

NEW = "h2"


def desired(replicas: int, per_gpu: int = 22 * GIB, tp: int = 1) -> Desired:
    return Desired(
        namespace="llm",
        name="qwen",
        replicas=replicas,
        template_hash=NEW,
        per_gpu_bytes=per_gpu,
        tp=tp,
    )


def cluster(pods: Sequence[PodView], gpus: int = 2, total: int = 80 * GIB) -> Capacity:
    status = KVShareNodeStatus(
        gpus=[
            GpuStatus(uuid=f"GPU-a{i}", index=i, total=total, free=total, slots=8)
            for i in range(gpus)
        ]
    )
    return build_capacity(
        {"node-a": NodeView("node-a", {}, (), True)},
        [GpuNodeView("node-a", status)],
        pods,
        {},
    )


def plan(want: Desired, pods: Sequence[PodView], **capacity: int) -> Plan:
    return plan_replicas(want, pods, lambda: cluster(pods, **capacity))


def deleted(result: Plan) -> list[tuple[str, str]]:
    return [(d.pod.name, d.reason) for d in result.deletes]


def test_missing_replicas_are_created_where_placement_puts_them() -> None:
    result = plan(desired(2, tp=2), [])
    assert [c.replica for c in result.creates] == [0, 1]
    for create in result.creates:
        assert create.placement == Placement("node-a", ("GPU-a0", "GPU-a1"))
    assert result.deletes == () and result.unplaced == {} and result.rollout is None


def test_nothing_to_place_never_reads_capacity() -> None:
    def no_capacity() -> Capacity:
        raise AssertionError("capacity read although nothing needed placing")

    pods = [pod(0, template=NEW), pod(1, template=NEW)]
    assert plan_replicas(desired(2), pods, no_capacity) == Plan()


def test_scale_down_removes_the_highest_indexes_first() -> None:
    pods = [pod(i, template=NEW) for i in range(4)]
    result = plan(desired(2), pods)
    assert deleted(result) == [("qwen-3", "ScaledDown"), ("qwen-2", "ScaledDown")]
    assert result.creates == ()


def test_a_finished_pod_is_replaced_and_its_index_waits_until_it_is_gone() -> None:
    result = plan(
        desired(2), [pod(0, template=NEW, phase="Failed", ready=False), pod(1, template=NEW)]
    )
    assert deleted(result) == [("qwen-0", "Replaced")]
    assert result.creates == ()  # same name: created once the failed pod is gone
    gone = plan(desired(2), [pod(0, template=NEW, terminating=True), pod(1, template=NEW)])
    assert gone.deletes == () and gone.creates == ()


def test_a_failed_pod_of_a_held_replica_stays_and_nothing_takes_its_index() -> None:
    pods = [pod(0, template=NEW, phase="Failed", ready=False), pod(1, template=NEW)]
    result = plan_replicas(desired(2), pods, lambda: cluster(pods), held={0})
    assert result == Plan()
    # Scaling down still removes a held replica.
    assert deleted(plan_replicas(desired(0), pods, lambda: cluster(pods), held={0})) == [
        ("qwen-1", "ScaledDown"),
        ("qwen-0", "ScaledDown"),
    ]


def test_a_spec_change_replaces_the_highest_ready_replica_first() -> None:
    pods = [pod(i) for i in range(3)]
    result = plan(desired(3), pods)
    assert deleted(result) == [("qwen-2", "RollingUpdate")]
    assert result.rollout is not None
    assert (result.rollout.updated, result.rollout.desired) == (0, 3)


def test_the_next_replica_waits_until_the_replacement_is_ready() -> None:
    starting = [pod(0), pod(1), pod(2, template=NEW, ready=False)]
    result = plan(desired(3), starting)
    assert result.deletes == ()
    assert result.rollout is not None
    assert result.rollout.waiting == "waiting for qwen-2 to become ready"
    ready = [pod(0), pod(1), pod(2, template=NEW)]
    assert deleted(plan(desired(3), ready)) == [("qwen-1", "RollingUpdate")]


def test_the_next_replica_waits_while_the_old_pod_stops_and_until_it_is_recreated() -> None:
    stopping = [pod(0), pod(1), pod(2, terminating=True)]
    result = plan(desired(3), stopping)
    assert result.deletes == () and result.creates == ()
    assert result.rollout is not None and "qwen-2 to stop" in result.rollout.waiting
    recreated = plan(desired(3), [pod(0), pod(1)])
    assert [c.replica for c in recreated.creates] == [2]
    assert recreated.deletes == ()


def test_unready_outdated_replicas_go_first_and_ready_ones_wait_for_availability() -> None:
    pods = [pod(0), pod(1, ready=False), pod(2)]
    assert deleted(plan(desired(3), pods)) == [("qwen-1", "RollingUpdate")]
    # A ready replica is never taken down while another one is unavailable.
    pods = [pod(0), pod(1, template=NEW), pod(2, template=NEW, phase="Failed", ready=False)]
    result = plan(desired(3), pods)
    assert deleted(result) == [("qwen-2", "Replaced")]
    assert result.rollout is not None
    assert "unavailable" in result.rollout.waiting


def test_a_replacement_that_cannot_be_placed_keeps_the_old_replica() -> None:
    # The new spec needs 90Gi per GPU; the GPUs have 80Gi.
    pods = [pod(0), pod(1)]
    result = plan(desired(2, per_gpu=60 * GIB), pods, gpus=1)
    assert result.deletes == ()
    assert result.rollout is not None
    assert result.rollout.waiting.startswith(
        "cannot replace qwen-1: no node has 1 GPU with 60Gi free"
    )


def test_the_replacement_may_use_the_memory_its_old_pod_frees() -> None:
    # One 80Gi GPU holds two 30Gi replicas; the new spec needs 40Gi each.
    pods = [pod(0, per_gpu=30 * GIB), pod(1, per_gpu=30 * GIB)]
    result = plan(desired(2, per_gpu=40 * GIB), pods, gpus=1)
    assert deleted(result) == [("qwen-1", "RollingUpdate")]


def test_replicas_no_gpu_could_hold_are_reported_and_not_created() -> None:
    result = plan(desired(2, per_gpu=100 * GIB), [])
    assert result.creates == ()
    assert result.too_large is not None
    assert "largest GPU offers 80.0Gi" in result.too_large
    assert set(result.unplaced) == {0, 1}


def test_replicas_that_do_not_fit_now_say_why() -> None:
    pods = [
        pod(0, ms="other", per_gpu=60 * GIB),
        pod(1, ms="other", gpus=("GPU-a1",), per_gpu=60 * GIB),
    ]
    result = plan_replicas(desired(1, per_gpu=30 * GIB), [], lambda: cluster(pods))
    assert result.creates == ()
    assert result.too_large is None
    assert result.unplaced == {
        0: "no node has 1 GPU with 30Gi free and a free slot (largest: 20Gi on node-a)"
    }
