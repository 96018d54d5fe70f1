"""Benchmark ``placement``: plan a large cluster from scratch, then one more replica.

Cluster: 2,000 nodes x 8 GPUs (80 GiB each, 8 slots), in four label classes with one
tainted class. Replicas: 10,000 with TP sizes 1/2/4 (60/30/10 %), static + KV minimum per
GPU drawn from 6-40 GiB, a quarter with a node selector, a few with co-location rules.
``full_plan_s``: ``place()`` of all replicas from scratch. ``incremental_p50_ms``: median
time to place one more replica into the full cluster with the incremental ``Planner``.
"""

from __future__ import annotations

import random
import statistics
import time

from harness import Result, Target
from kvshare.api.placement import (
    GpuState,
    NodeState,
    Placement,
    Planner,
    ReplicaRequest,
    Taint,
    Tolerance,
    place,
)

GIB = 2**30
ZONES = ("zone-a", "zone-b", "zone-c", "zone-d")


def make_nodes(count: int, gpus_per_node: int) -> list[NodeState]:
    nodes = []
    for n in range(count):
        zone = ZONES[n % len(ZONES)]
        taints = (Taint("dedicated", "batch", "NoSchedule"),) if zone == "zone-d" else ()
        gpus = tuple(
            GpuState(uuid=f"GPU-{n:05d}-{g}", index=g, free_bytes=80 * GIB, free_slots=8)
            for g in range(gpus_per_node)
        )
        nodes.append(NodeState(f"gpu-node-{n:05d}", gpus, {"zone": zone}, taints))
    return nodes


def make_replicas(count: int, seed: int = 7, prefix: str = "r") -> list[ReplicaRequest]:
    rng = random.Random(seed)
    replicas = []
    for i in range(count):
        tp = rng.choices((1, 2, 4), weights=(60, 30, 10))[0]
        group = f"team-{i % 50}/model-{i % 400}"
        selector = {"zone": rng.choice(ZONES[:3])} if rng.random() < 0.25 else {}
        tolerations = (Tolerance("dedicated", "Equal", "batch"),) if rng.random() < 0.2 else ()
        avoid = frozenset({f"team-{i % 50}/model-{(i + 1) % 400}"}) if i % 97 == 0 else frozenset()
        colocate = (
            frozenset({f"team-{i % 50}/model-{(i + 2) % 400}"}) if i % 89 == 0 else frozenset()
        )
        replicas.append(
            ReplicaRequest(
                key=f"{prefix}-{i}",
                group=group,
                per_gpu_bytes=rng.randint(6, 40) * GIB,
                tp=tp,
                node_selector=selector,
                tolerations=tolerations,
                avoid=avoid,
                colocate_with=colocate,
                policy="spread" if i % 10 == 0 else "binpack",
            )
        )
    return replicas


def run(quick: bool) -> Result:
    nodes_count, gpus_per_node, replicas_count = (200, 8, 1_000) if quick else (2_000, 8, 10_000)
    nodes = make_nodes(nodes_count, gpus_per_node)
    replicas = make_replicas(replicas_count)

    start = time.perf_counter()
    plan = place(replicas, nodes)
    full_plan_s = time.perf_counter() - start
    placed = [r for r in replicas if isinstance(plan[r.key], Placement)]

    planner = Planner(nodes)
    for replica in placed:
        placement = plan[replica.key]
        assert isinstance(placement, Placement)
        planner.commit(replica, placement)
    extra = make_replicas(200, seed=11, prefix="extra")
    samples = []
    for replica in extra:
        begin = time.perf_counter()
        planner.place(replica)
        samples.append((time.perf_counter() - begin) * 1000)

    return Result(
        name="placement",
        fields={
            "replicas": replicas_count,
            "nodes": nodes_count,
            "gpus_per_node": gpus_per_node,
            "placed": len(placed),
            "full_plan_s": round(full_plan_s, 4),
            "incremental_p50_ms": round(statistics.median(samples), 4),
        },
        targets=[Target("full_plan_s", "<=", 2.0), Target("incremental_p50_ms", "<=", 10.0)],
    )
