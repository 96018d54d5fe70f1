"""The operator process against the emulated API: a ModelServer's life from creation to
deletion, through readiness, a rolling update and scaling.

kopf runs for real (``kvshare operator``, as its Deployment runs it) and talks HTTP to
kmock's Kubernetes emulator (see ``kube.py``). The test plays the node agent and the
kubelet: it publishes KVShareNodes and reports pod readiness.
"""

from __future__ import annotations

import asyncio

import pytest

from kvshare.api import env, names
from kvshare.api.kvsharenode import PoolStatus
from tests.operator.harness import (
    GIB,
    MS,
    NAMESPACE,
    PODS,
    SERVICES,
    Cluster,
    Gpu,
    StartOperator,
    all_ready,
    eventually,
    metric,
    wait_for,
)
from tests.operator.specs import modelserver

pytestmark = pytest.mark.asyncio


def hashes(cluster: Cluster) -> dict[str, str]:
    return {
        n: p["metadata"]["labels"][names.LABEL_TEMPLATE_HASH] for n, p in cluster.pods().items()
    }


async def test_a_modelserver_gets_pinned_pods_a_service_and_a_placed_status(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    await cluster.add_gpu_node("gpu-node-2", [Gpu("GPU-2a"), Gpu("GPU-2b")])
    start_operator()
    created = await cluster.create(
        MS,
        modelserver(
            replicas=2,
            tensorParallelSize=2,
            engineArgs=["--enable-prefix-caching"],
            imagePullSecrets=[{"name": "registry-credentials"}],
            serviceAccountName="model-reader",
            podLabels={"team": "research"},
        ),
    )
    uid = created["metadata"]["uid"]
    pods = await wait_for(lambda: len(cluster.pods()) == 2 and cluster.pods(), "two pods")

    nodes = set()
    for name, pod in pods.items():
        meta, spec = pod["metadata"], pod["spec"]
        node = meta["annotations"][names.ANNOTATION_NODE]
        gpus = meta["annotations"][names.ANNOTATION_GPUS].split(",")
        nodes.add(node)
        # Two distinct GPUs of the node the pod is pinned to.
        assert len(set(gpus)) == 2 and all(g.startswith(f"GPU-{node[-1]}") for g in gpus)
        affinity = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert affinity["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [node]
        assert meta["ownerReferences"][0]["uid"] == uid
        (engine,) = spec["containers"]
        assert engine["command"][:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
        assert engine["command"][-1] == "--enable-prefix-caching"
        assert engine["resources"]["limits"][names.RESOURCE_GPU] == "2"
        assert engine["resources"]["limits"][names.RESOURCE_GPU_MEMORY] == "44"
        values = {e["name"]: e.get("value") for e in engine["env"]}
        assert values[env.ENABLE.name] == "1"
        assert values["PYTHONPATH"] == names.RUNTIME_MOUNT_DIR
        assert values[env.MODELSERVER.name] == "qwen"
        assert [c["image"] for c in spec["initContainers"]] == ["registry.example/kvshare:test"]
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
        assert spec["serviceAccountName"] == "model-reader"
        assert meta["labels"]["team"] == "research"
        assert {v["name"] for v in spec["volumes"]} == {"kvshare-runtime", "dshm"}
        assert name in ("qwen-0", "qwen-1")
    # Binpack fills one node first: both replicas fit on gpu-node-1's two GPUs.
    assert nodes == {"gpu-node-1"}

    service = await wait_for(lambda: cluster.get(SERVICES, NAMESPACE, "qwen"), "the Service")
    assert service["spec"]["selector"][names.LABEL_MODELSERVER] == "qwen"
    assert service["metadata"]["ownerReferences"][0]["uid"] == uid

    await wait_for(lambda: cluster.condition("qwen", "Placed").get("status") == "True", "Placed")
    status = cluster.status("qwen")
    assert status["phase"] == "Starting"
    assert status["ready"] == "0/2"
    assert status["endpoint"] == "http://qwen.llm.svc:8000"
    assert [p["pod"] for p in status["placements"]] == ["qwen-0", "qwen-1"]
    placed = await wait_for(
        lambda: len(cluster.events("Placed")) == 2 and cluster.events("Placed"), "two Placed events"
    )
    assert all(e["involvedObject"]["uid"] == uid for e in placed)


async def test_ready_pods_make_it_ready_and_kv_usage_comes_from_the_node_agent(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    gpus = [Gpu("GPU-1a"), Gpu("GPU-1b")]
    await cluster.add_gpu_node("gpu-node-1", gpus)
    process = start_operator()
    await cluster.create(MS, modelserver(replicas=2))
    await all_ready(cluster, "qwen", 2)
    await wait_for(lambda: cluster.status("qwen").get("phase") == "Ready", "phase Ready")
    assert cluster.condition("qwen", "Ready")["reason"] == "ReplicasReady"
    assert cluster.condition("qwen", "Progressing")["status"] == "False"
    await wait_for(lambda: cluster.events("Ready"), "a Ready event")

    # The engines started: the node agent reports their pools.
    for pod in ("qwen-0", "qwen-1"):
        gpus[0].pools.append(
            PoolStatus(
                namespace=NAMESPACE,
                pod=pod,
                modelserver="qwen",
                static=18 * GIB,
                kv_min=4 * GIB,
                lease=10 * GIB,
                want=12 * GIB,
                mapped=6 * GIB,
                used=3 * GIB,
            )
        )
    await cluster.publish_gpu_node("gpu-node-1", gpus)
    kv = await wait_for(
        lambda: (
            cluster.status("qwen").get("kv", {}).get("lease") == "20Gi"
            and cluster.status("qwen")["kv"]
        ),
        "KV usage in the status",
    )
    assert kv == {"min": "8Gi", "lease": "20Gi", "mapped": "12Gi", "used": "6Gi", "demand": "24Gi"}
    assert (await metric(process, "kvshare_modelservers"))['{phase="Ready"}'] == 1.0
    qwen = '{modelserver="qwen",namespace="llm"}'
    assert (await metric(process, "kvshare_modelserver_status_phase"))[
        '{modelserver="qwen",namespace="llm",phase="Ready"}'
    ] == 1.0
    assert (await metric(process, "kvshare_modelserver_replicas")) == {qwen: 2.0}
    assert (await metric(process, "kvshare_modelserver_ready_replicas")) == {qwen: 2.0}
    assert (await metric(process, "kvshare_modelserver_kv_lease_bytes")) == {qwen: 20.0 * GIB}
    # The workers ask for 24 GiB and are lent 20: the pressure autoscalers scale out on.
    assert (await metric(process, "kvshare_modelserver_kv_pressure_ratio")) == {qwen: 1.2}
    assert (await metric(process, "kvshare_operator_placements_total"))['{result="placed"}'] == 2.0


async def test_an_image_change_rolls_one_replica_at_a_time(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    start_operator()
    await cluster.create(MS, modelserver(replicas=3))
    await all_ready(cluster, "qwen", 3)
    old = hashes(cluster)["qwen-0"]
    generation = cluster.get(MS, NAMESPACE, "qwen")["metadata"]["generation"]  # type: ignore[index]

    await cluster.patch(MS, NAMESPACE, "qwen", {"spec": {"image": "vllm/vllm-openai:v0.33.1"}})
    for replaced in ("qwen-2", "qwen-1", "qwen-0"):
        new = await wait_for(
            lambda r=replaced: hashes(cluster).get(r, old) != old and hashes(cluster)[r],
            f"{replaced} replaced",
        )
        # While the replacement starts, every other replica keeps running its old spec.
        await asyncio.sleep(0.5)
        current = hashes(cluster)
        assert len(current) == 3
        assert sum(h == new for h in current.values()) == 3 - int(replaced[-1])
        assert cluster.condition("qwen", "Progressing")["reason"] == "RollingUpdate"
        await cluster.set_ready(replaced)

    await wait_for(
        lambda: cluster.condition("qwen", "Progressing").get("reason") == "UpToDate",
        "the rollout to finish",
    )
    status = cluster.status("qwen")
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == generation + 1
    pods = cluster.pods()
    assert {p["spec"]["containers"][0]["image"] for p in pods.values()} == {
        "vllm/vllm-openai:v0.33.1"
    }
    rolled = await wait_for(
        lambda: (
            len(cluster.events("RollingUpdate")) == 3
            and [e["message"] for e in cluster.events("RollingUpdate")]
        ),
        "three RollingUpdate events",
    )
    assert any("replacing replica 2 (pod qwen-2)" in message for message in rolled)


async def test_scaling_removes_the_highest_replicas_first_and_adds_missing_ones(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a"), Gpu("GPU-1b")])
    start_operator()
    await cluster.create(MS, modelserver(replicas=4))
    await all_ready(cluster, "qwen", 4)
    deleted: list[str] = []

    def watch_deletes() -> list[str]:
        deleted.extend(
            c.name for c in cluster.emulator.api_calls
            if c.verb == "delete" and c.resource == "pods" and c.name and c.name not in deleted
        )  # fmt: skip
        return deleted

    await cluster.patch(MS, NAMESPACE, "qwen", {"spec": {"replicas": 2}})
    await wait_for(lambda: sorted(cluster.pods()) == ["qwen-0", "qwen-1"], "scale down to 2")
    assert watch_deletes() == ["qwen-3", "qwen-2"]
    await wait_for(lambda: cluster.status("qwen").get("ready") == "2/2", "2/2 ready")
    await wait_for(
        lambda: [e["message"] for e in cluster.events("Scaled")] == ["replicas 4 -> 2"],
        "a Scaled event",
    )

    await cluster.patch(MS, NAMESPACE, "qwen", {"spec": {"replicas": 3}})
    await wait_for(lambda: sorted(cluster.pods()) == ["qwen-0", "qwen-1", "qwen-2"], "scale up")
    await wait_for(lambda: cluster.status("qwen").get("ready") == "2/3", "2/3 ready")


async def test_deleting_a_modelserver_is_left_to_owner_references(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    """kmock has no garbage collector: the pods stay, and the test checks what the real
    one acts on (owner references); tests/e2e checks the deletion on a real cluster."""
    await cluster.add_gpu_node("gpu-node-1", [Gpu("GPU-1a")])
    process = start_operator()
    uid = (await cluster.create(MS, modelserver(replicas=2)))["metadata"]["uid"]
    await wait_for(lambda: cluster.status("qwen").get("replicas") == 2, "two replicas")
    assert (await metric(process, "kvshare_modelservers"))['{phase="Starting"}'] == 1.0
    assert (await metric(process, "kvshare_modelserver_replicas")) == {
        '{modelserver="qwen",namespace="llm"}': 2.0
    }
    assert "finalizers" not in cluster.get(MS, NAMESPACE, "qwen")["metadata"]  # type: ignore[index]

    await cluster.delete(MS, NAMESPACE, "qwen")
    assert cluster.get(MS, NAMESPACE, "qwen") is None  # nothing held the deletion

    made = [*cluster.list(PODS, NAMESPACE), *cluster.list(SERVICES, NAMESPACE)]
    assert len(made) == 3
    for obj in made:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "ModelServer", "qwen", uid, True,
        )  # fmt: skip

    async def forgotten() -> bool:
        counts = await metric(process, "kvshare_modelservers")
        per_modelserver = await metric(process, "kvshare_modelserver_")
        return sum(counts.values()) == 0 and per_modelserver == {}

    await eventually(forgotten, "the operator to forget the deleted ModelServer")

    # Events of the orphaned pods (until the garbage collector removes them) change nothing.
    creates = sum(c.verb == "create" and c.resource == "pods" for c in cluster.emulator.api_calls)
    await cluster.set_ready("qwen-0")
    await asyncio.sleep(1.0)
    assert (
        sum(c.verb == "create" and c.resource == "pods" for c in cluster.emulator.api_calls)
        == creates
    )
    assert cluster.get(MS, NAMESPACE, "qwen") is None
    assert "Traceback" not in process.log()
