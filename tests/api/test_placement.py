"""Placement never over-commits, keeps TP replicas on distinct GPUs of one node, is stable
and deterministic, and explains what it cannot place."""

from __future__ import annotations

import random
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.api.placement import (
    GpuState,
    NodeState,
    Placement,
    Planner,
    ReplicaRequest,
    Taint,
    Tolerance,
    Unplaced,
    place,
)

GIB = 2**30


def node(name: str, frees: list[int], slots: int = 8, **kwargs: object) -> NodeState:
    gpus = tuple(
        GpuState(uuid=f"{name}-gpu{i}", index=i, free_bytes=free * GIB, free_slots=slots)
        for i, free in enumerate(frees)
    )
    return NodeState(name, gpus, **kwargs)  # type: ignore[arg-type]


def replica(key: str, gib: int, tp: int = 1, **kwargs: object) -> ReplicaRequest:
    group = str(kwargs.pop("group", key))
    return ReplicaRequest(key=key, group=group, per_gpu_bytes=gib * GIB, tp=tp, **kwargs)  # type: ignore[arg-type]


def test_binpack_fills_the_node_with_least_room_first() -> None:
    nodes = [node("a", [80, 80]), node("b", [30, 80])]
    result = place([replica("r", 20)], nodes)
    assert result["r"] == Placement("b", ("b-gpu0",))


def test_spread_takes_the_node_with_most_room() -> None:
    nodes = [node("a", [80, 80]), node("b", [30, 80])]
    result = place([replica("r", 20, policy="spread")], nodes)
    assert result["r"] == Placement("a", ("a-gpu0",))


def test_tensor_parallel_replica_takes_distinct_gpus_of_one_node() -> None:
    nodes = [node("a", [40, 10, 40]), node("b", [40])]
    result = place([replica("r", 30, tp=2)], nodes)
    assert result["r"] == Placement("a", ("a-gpu0", "a-gpu2"))


def test_unplaceable_replica_says_what_is_missing_and_the_largest_room() -> None:
    nodes = [node("gpu-node-3", [31, 31, 10]), node("gpu-node-4", [20, 20])]
    result = place([replica("r", 38, tp=2)], nodes)
    assert result["r"] == Unplaced(
        "no node has 2 GPUs with 38Gi free and a free slot (largest: 31Gi on gpu-node-3)"
    )


def test_node_selector_and_taints_filter_nodes_and_are_explained() -> None:
    nodes = [
        node("a", [80], labels={"zone": "x"}),
        node("b", [80], labels={"zone": "y"}, taints=(Taint("dedicated", "batch"),)),
        node("c", [80], labels={"zone": "y"}, schedulable=False),
    ]
    result = place([replica("r", 10, node_selector={"zone": "y"})], nodes)
    assert isinstance(result["r"], Unplaced)
    assert result["r"].reason == (
        "no node is eligible (3 nodes: 1 cordoned; 1 not matching nodeSelector zone=y; "
        "1 with taints the replica does not tolerate)"
    )
    tolerant = replica(
        "r", 10, node_selector={"zone": "y"}, tolerations=(Tolerance("dedicated", "Exists"),)
    )
    assert place([tolerant], nodes)["r"] == Placement("b", ("b-gpu0",))


def test_prefer_no_schedule_taints_do_not_block() -> None:
    nodes = [node("a", [80], taints=(Taint("soft", "", "PreferNoSchedule"),))]
    assert isinstance(place([replica("r", 10)], nodes)["r"], Placement)


def test_no_nodes_means_no_node_agent() -> None:
    result = place([replica("r", 10)], [])
    assert result["r"] == Unplaced("no GPU nodes are known (is the kvshare node agent running?)")


def test_unhealthy_draining_and_slotless_gpus_take_nothing() -> None:
    gpus = (
        GpuState("u0", 0, 80 * GIB, 8, healthy=False),
        GpuState("u1", 1, 80 * GIB, 8, draining=True),
        GpuState("u2", 2, 80 * GIB, 0),
        GpuState("u3", 3, 80 * GIB, 8),
    )
    result = place([replica("a", 10), replica("b", 10, tp=2)], [NodeState("n", gpus)])
    assert result["a"] == Placement("n", ("u3",))
    assert isinstance(result["b"], Unplaced)


def test_current_placements_are_kept_and_consume_capacity() -> None:
    nodes = [node("a", [40]), node("b", [40])]
    kept = replica("old", 30, current=Placement("b", ("b-gpu0",)))
    result = place([kept, replica("new", 30)], nodes)
    assert result["old"] == Placement("b", ("b-gpu0",))
    assert result["new"] == Placement("a", ("a-gpu0",))


def test_avoid_is_hard_and_symmetric() -> None:
    nodes = [node("a", [80, 80])]
    first = place(
        [replica("x", 10, group="g1", avoid=frozenset({"g2"})), replica("y", 10, group="g2")], nodes
    )
    assert first["x"] != first["y"]
    assert isinstance(first["y"], Placement)
    assert set(first["x"].gpus).isdisjoint(first["y"].gpus)  # type: ignore[union-attr]
    one_gpu = [node("a", [80])]
    blocked = place(
        [replica("x", 10, group="g1"), replica("y", 10, group="g2", avoid=frozenset({"g1"}))],
        one_gpu,
    )
    assert isinstance(blocked["y"], Unplaced)
    assert "not shared with g1" in blocked["y"].reason


def test_colocate_with_prefers_gpus_of_the_named_group() -> None:
    nodes = [node("a", [80]), node("b", [20])]
    planner = Planner(nodes)
    planner.commit(replica("x", 10, group="g1"), Placement("a", ("a-gpu0",)))
    # Binpack alone would pick b (least room); the preference wins where it fits.
    assert planner.place(
        replica("y", 10, group="g2", colocate_with=frozenset({"g1"}))
    ) == Placement("a", ("a-gpu0",))
    # Where the preferred GPU is full, placement falls back to the normal policy.
    assert planner.place(replica("z", 75, group="g3", colocate_with=frozenset({"g1"}))) == Unplaced(
        "no node has 1 GPU with 75Gi free and a free slot (largest: 60Gi on a)"
    )


def test_placement_does_not_depend_on_input_order() -> None:
    rng = random.Random(3)
    nodes = [node(f"n{i}", [rng.choice([24, 40, 80]) for _ in range(4)]) for i in range(6)]
    replicas = [replica(f"r{i}", rng.randint(4, 30), tp=rng.choice([1, 2])) for i in range(20)]
    expected = place(replicas, nodes)
    for _ in range(5):
        rng.shuffle(replicas)
        rng.shuffle(nodes)
        assert place(replicas, nodes) == expected


# --- properties ------------------------------------------------------------------------

gpu_frees = st.lists(st.integers(min_value=0, max_value=80), min_size=1, max_size=8)
cluster = st.lists(
    st.tuples(gpu_frees, st.integers(min_value=0, max_value=4), st.booleans()),
    min_size=1,
    max_size=6,
)
requests = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=60),
        st.sampled_from([1, 2, 4, 8]),
        st.sampled_from(["binpack", "spread"]),
        st.integers(min_value=0, max_value=3),
        st.integers(min_value=0, max_value=3),
    ),
    max_size=30,
)


def build(spec: list[tuple[list[int], int, bool]]) -> list[NodeState]:
    nodes = []
    for n, (frees, slots, labelled) in enumerate(spec):
        labels = {"pool": "gold"} if labelled else {}
        nodes.append(node(f"node-{n}", frees, slots=slots, labels=labels))
    return nodes


def build_replicas(spec: list[tuple[int, int, str, int, int]]) -> list[ReplicaRequest]:
    out = []
    for i, (gib, tp, policy, group, avoided) in enumerate(spec):
        out.append(
            replica(
                f"r{i}",
                gib,
                tp=tp,
                policy=policy,
                group=f"g{group}",
                avoid=frozenset({f"g{avoided}"}) if avoided != group else frozenset(),
                node_selector={"pool": "gold"} if i % 3 == 0 else {},
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(cluster, requests)
def test_never_over_commits_memory_or_slots(
    node_spec: list[tuple[list[int], int, bool]], replica_spec: list[tuple[int, int, str, int, int]]
) -> None:
    nodes = build(node_spec)
    replicas = build_replicas(replica_spec)
    result = place(replicas, nodes)
    used_bytes: dict[str, int] = defaultdict(int)
    used_slots: dict[str, int] = defaultdict(int)
    groups: dict[str, set[str]] = defaultdict(set)
    by_uuid = {gpu.uuid: (n, gpu) for n in nodes for gpu in n.gpus}
    for r in replicas:
        placed = result[r.key]
        if isinstance(placed, Unplaced):
            assert placed.reason
            continue
        # TP replicas: exactly tp distinct GPUs, all on the placement's node.
        assert len(placed.gpus) == r.tp == len(set(placed.gpus))
        for uuid in placed.gpus:
            owner, _ = by_uuid[uuid]
            assert owner.name == placed.node
            assert all(owner.labels.get(k) == v for k, v in r.node_selector.items())
            used_bytes[uuid] += r.per_gpu_bytes
            used_slots[uuid] += 1
            groups[uuid].add(r.group)
    for uuid, (_, gpu) in by_uuid.items():
        assert used_bytes[uuid] <= gpu.free_bytes
        assert used_slots[uuid] <= gpu.free_slots
    for r in replicas:
        placed = result[r.key]
        if isinstance(placed, Placement):
            for uuid in placed.gpus:
                assert not (r.avoid & groups[uuid])


@settings(max_examples=100, deadline=None)
@given(cluster, requests)
def test_same_input_gives_same_output(
    node_spec: list[tuple[list[int], int, bool]], replica_spec: list[tuple[int, int, str, int, int]]
) -> None:
    assert place(build_replicas(replica_spec), build(node_spec)) == place(
        build_replicas(replica_spec), build(node_spec)
    )


@settings(max_examples=100, deadline=None)
@given(cluster, requests, st.randoms(use_true_random=False))
def test_placed_replicas_never_move_when_more_arrive(
    node_spec: list[tuple[list[int], int, bool]],
    replica_spec: list[tuple[int, int, str, int, int]],
    rng: random.Random,
) -> None:
    nodes = build(node_spec)
    replicas = build_replicas(replica_spec)
    first = place(replicas, nodes)
    kept = [
        ReplicaRequest(**{**r.__dict__, "current": first[r.key]})
        if isinstance(first[r.key], Placement)
        else r
        for r in replicas
    ]
    extra = build_replicas([(rng.randint(0, 40), 1, "binpack", 0, 0) for _ in range(5)])
    extra = [ReplicaRequest(**{**r.__dict__, "key": f"extra-{r.key}"}) for r in extra]
    second = place(kept + extra, nodes)
    for r in replicas:
        if isinstance(first[r.key], Placement):
            assert second[r.key] == first[r.key]
