"""Rendered pods and Services: the engine's own command line, pinning, resources, the
injected runtime, and the hash that decides when a replica is outdated."""

from __future__ import annotations

from typing import Any

import pytest

from kvshare.api import env, names
from kvshare.api.modelserver import ENGINE_COMMAND_LINES
from kvshare.api.placement import Placement
from kvshare.operator.render import (
    ENGINE_CONTAINER,
    RUNTIME_INIT_CONTAINER,
    RUNTIME_VOLUME,
    RuntimeImage,
    inject_runtime,
    render_pod,
    render_service,
    template_hash,
)
from kvshare.operator.views import pod_view
from tests.operator.specs import GIB, parsed, ref

RUNTIME = RuntimeImage("registry.example/kvshare:1.0", "Always")
PLACEMENT = Placement("gpu-node-3", ("GPU-3a", "GPU-3b"))


def render(replica: int = 1, **overrides: Any) -> dict[str, Any]:
    ms = ref(**overrides)
    spec = parsed(**overrides)
    return render_pod(
        ms, spec, replica=replica, placement=PLACEMENT, template="abc123", runtime=RUNTIME
    )


def engine(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    assert container["name"] == ENGINE_CONTAINER
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_vllm_pod_runs_vllm_serve_with_kvshare_flags_then_the_users() -> None:
    pod = render(engineArgs=["--max-model-len", "8192"], tensorParallelSize=2, port=9000)
    assert engine(pod)["command"] == [
        "vllm", "serve", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "0.0.0.0", "--port", "9000", "--tensor-parallel-size", "2",
        "--max-model-len", "8192",
    ]  # fmt: skip
    assert engine(pod)["image"] == "vllm/vllm-openai:v0.33.0"


def test_sglang_pod_runs_launch_server_with_its_own_flag_names() -> None:
    pod = render(engine="sglang", image="lmsysorg/sglang:v0.5.23", tensorParallelSize=4)
    assert engine(pod)["command"] == [
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "0.0.0.0", "--port", "8000", "--tp-size", "4",
    ]  # fmt: skip


@pytest.mark.parametrize("engine_name", sorted(ENGINE_COMMAND_LINES))
def test_memory_sizing_flags_the_runtime_replaces_are_never_passed(engine_name: str) -> None:
    image = {"vllm": "vllm/vllm-openai:v0.33.0", "sglang": "lmsysorg/sglang:v0.5.23"}
    command = engine(render(engine=engine_name, image=image[engine_name]))["command"]
    for flag in ENGINE_COMMAND_LINES[engine_name].replaced:
        assert flag not in command


def test_a_vllm_0_34_pod_turns_vllm_s_own_kv_reservation_off_before_the_users_flags() -> None:
    # vLLM 0.34's extensible KV cache would reserve the KV memory itself and default the
    # memory utilization to the whole GPU; kvshare's pool is the KV allocation.
    pod = render(image="vllm/vllm-openai:v0.34.0", engineArgs=["--max-model-len", "8192"])
    assert engine(pod)["command"][-3:] == [
        "--no-enable-extensible-kv-cache", "--max-model-len", "8192",
    ]  # fmt: skip
    assert "--no-enable-extensible-kv-cache" not in engine(render())["command"]  # 0.33


def test_pod_is_pinned_to_its_node_by_required_affinity_and_names_its_gpus() -> None:
    pod = render()
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-3"]}]}
    ]
    assert "nodeName" not in pod["spec"]
    assert pod["metadata"]["annotations"] == {
        names.ANNOTATION_NODE: "gpu-node-3",
        names.ANNOTATION_GPUS: "GPU-3a,GPU-3b",
        # The KV policy, which the node agent applies in place when it changes.
        names.ANNOTATION_KV_POLICY: '{"max":"40Gi","min":"4Gi","priority":200}',
    }


def test_pod_identity_labels_and_controller_owner_reference() -> None:
    pod = render(replica=4)
    assert pod["metadata"]["name"] == "qwen-4"
    assert pod["metadata"]["namespace"] == "llm"
    assert pod["metadata"]["labels"] == {
        names.LABEL_MODELSERVER: "qwen",
        names.LABEL_REPLICA: "4",
        names.LABEL_TEMPLATE_HASH: "abc123",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": names.API_VERSION,
            "kind": names.MODELSERVER_KIND,
            "name": "qwen",
            "uid": "uid-qwen",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def test_pod_requests_gpu_slots_and_memory_units_next_to_the_users_resources() -> None:
    pod = render(
        tensorParallelSize=2,
        staticMemory="18.5Gi",
        resources={"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "40Gi"}},
    )
    resources = engine(pod)["resources"]
    # 18.5Gi + 4Gi per worker rounds up to 23 units, times two workers.
    assert resources["requests"] == {
        "cpu": "4",
        "memory": "32Gi",
        names.RESOURCE_GPU: "2",
        names.RESOURCE_GPU_MEMORY: "46",
    }
    assert resources["limits"] == {
        "memory": "40Gi",
        names.RESOURCE_GPU: "2",
        names.RESOURCE_GPU_MEMORY: "46",
    }


def test_engine_env_carries_policy_identity_and_the_runtime_after_the_users() -> None:
    pod = render(
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
    )
    container = engine(pod)
    assert container["env"][0]["name"] == "HF_TOKEN"
    values = env_of(container)
    assert values[env.ENABLE.name] == "1"
    assert values["PYTHONPATH"] == names.RUNTIME_MOUNT_DIR
    assert values[env.MODELSERVER.name] == "qwen"
    assert values[env.STATIC_BYTES.name] == str(18 * GIB)
    assert values[env.KV_MIN.name] == str(4 * GIB)
    assert values[env.KV_MAX.name] == str(40 * GIB)
    assert values[env.KV_PRIORITY.name] == "200"
    assert values[env.POD_NAMESPACE.name] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert values[env.POD_NAME.name] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert values[env.POD_UID.name] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    # Every KVSHARE_ name the operator writes is one the runtime reads.
    known = {var.name for var in env.ALL}
    assert {n for n in values if n.startswith("KVSHARE_")} <= known


def test_init_container_copies_the_bundle_into_a_volume_the_engine_mounts_read_only() -> None:
    pod = render()
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == RUNTIME_INIT_CONTAINER
    assert init["image"] == "registry.example/kvshare:1.0"
    assert init["imagePullPolicy"] == "Always"
    assert init["command"][-2:] == [names.RUNTIME_BUNDLE_DIR, names.RUNTIME_MOUNT_DIR]
    assert init["volumeMounts"] == [{"name": RUNTIME_VOLUME, "mountPath": names.RUNTIME_MOUNT_DIR}]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes[RUNTIME_VOLUME]
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    mounts = {m["name"]: m for m in engine(pod)["volumeMounts"]}
    assert mounts[RUNTIME_VOLUME] == {
        "name": RUNTIME_VOLUME,
        "mountPath": names.RUNTIME_MOUNT_DIR,
        "readOnly": True,
    }
    assert mounts["dshm"]["mountPath"] == "/dev/shm"


def test_probes_ask_the_engines_health_endpoint_on_its_port() -> None:
    container = engine(render(port=9000))
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Loading weights must not be killed by the liveness probe.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600


def test_pull_secrets_service_account_labels_and_annotations_reach_the_pod() -> None:
    pod = render(
        replica=2,
        imagePullSecrets=[{"name": "registry-credentials"}, {"name": "mirror"}],
        serviceAccountName="model-reader",
        podLabels={"team": "research"},
        podAnnotations={"sidecar.istio.io/inject": "false"},
    )
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}, {"name": "mirror"}]
    assert spec["serviceAccountName"] == "model-reader"
    # The user's labels join kvshare's, which the Service and the operator select by.
    assert pod["metadata"]["labels"] == {
        "team": "research",
        names.LABEL_MODELSERVER: "qwen",
        names.LABEL_REPLICA: "2",
        names.LABEL_TEMPLATE_HASH: "abc123",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }
    assert pod["metadata"]["annotations"] == {
        "sidecar.istio.io/inject": "false",
        names.ANNOTATION_NODE: "gpu-node-3",
        names.ANNOTATION_GPUS: "GPU-3a,GPU-3b",
        names.ANNOTATION_KV_POLICY: '{"max":"40Gi","min":"4Gi","priority":200}',
    }
    view = pod_view({**pod, "metadata": {**pod["metadata"], "uid": "u-2"}})
    assert view is not None and (view.replica, view.node) == (2, "gpu-node-3")


def test_without_them_the_pod_uses_the_namespace_defaults() -> None:
    spec = render()["spec"]
    assert "imagePullSecrets" not in spec
    assert "serviceAccountName" not in spec


def test_tolerations_pass_through_and_service_links_are_off() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    pod = render(tolerations=[toleration])
    assert pod["spec"]["tolerations"] == [toleration]
    assert pod["spec"]["enableServiceLinks"] is False


def test_injection_is_idempotent_and_keeps_a_users_pythonpath() -> None:
    pod = {
        "spec": {
            "containers": [
                {"name": "app", "env": [{"name": "PYTHONPATH", "value": "/app/lib"}]},
                {"name": "sidecar"},
            ]
        }
    }
    once = inject_runtime(pod, RUNTIME, ["app"])
    assert inject_runtime(once, RUNTIME, ["app"]) == once
    app, sidecar = once["spec"]["containers"]
    assert env_of(app)["PYTHONPATH"] == f"{names.RUNTIME_MOUNT_DIR}:/app/lib"
    assert [e["name"] for e in app["env"]].count("PYTHONPATH") == 1
    assert sidecar == {"name": "sidecar"}
    assert pod["spec"]["containers"][1] == {"name": "sidecar"}  # the input is not modified


def test_service_selects_the_modelservers_pods_on_the_engine_port() -> None:
    service = render_service(ref(), parsed(port=9000))
    assert service["metadata"]["name"] == "qwen"
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
    assert service["spec"]["selector"] == {
        names.LABEL_MODELSERVER: "qwen",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_template_hash_follows_what_shapes_the_pod_and_only_that() -> None:
    base = template_hash(parsed())
    assert template_hash(parsed()) == base
    assert template_hash(parsed(image="vllm/vllm-openai:v0.33.1")) != base
    # The KV policy reaches running replicas in place: it never rolls them.
    assert template_hash(parsed(kvCache={"min": "5Gi", "max": "80Gi", "priority": 900})) == base
    # Placement-only fields never replace a running replica.
    assert template_hash(parsed(replicas=5, nodeSelector={"zone": "a"})) == base
    assert template_hash(parsed(placementPolicy="Spread", avoidColocationWith=["x"])) == base
    # A default spelled out is the same spec.
    assert template_hash(parsed(port=8000, dtype="bfloat16")) == base
    assert template_hash(parsed(imagePullSecrets=[], podLabels={}, podAnnotations={})) == base
    # What the pod runs as and carries rolls the replicas like any other pod change.
    pod_fields = [
        {"imagePullSecrets": [{"name": "registry-credentials"}]},
        {"serviceAccountName": "model-reader"},
        {"podLabels": {"team": "research"}},
        {"podAnnotations": {"sidecar.istio.io/inject": "false"}},
    ]
    hashes = {template_hash(parsed(**change)) for change in pod_fields}
    assert len(hashes) == len(pod_fields) and base not in hashes


def test_the_pod_reads_back_as_the_view_placement_counts() -> None:
    body = render(replica=2, tensorParallelSize=2)
    body["metadata"]["uid"] = "u-1"
    view = pod_view(body)
    assert view is not None
    assert (view.name, view.replica, view.modelserver, view.template_hash) == (
        "qwen-2", 2, "qwen", "abc123",
    )  # fmt: skip
    assert view.node == "gpu-node-3"
    assert view.gpus == ("GPU-3a", "GPU-3b")
    assert view.per_gpu_bytes == 22 * GIB
    assert (view.ready, view.terminating, view.finished) == (False, False, False)


def test_an_unscheduled_pod_reads_back_with_the_schedulers_reason() -> None:
    body = render()
    body["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient kvshare.io/gpu."}],
    }  # fmt: skip
    view = pod_view(body)
    assert view is not None
    assert view.message == "0/3 nodes are available: 3 Insufficient kvshare.io/gpu."


def _read_back(status: dict[str, Any]) -> Any:
    body = render()
    body["status"] = status
    view = pod_view(body)
    assert view is not None
    return view


def test_a_pod_the_node_refused_reads_back_with_why() -> None:
    view = _read_back(
        {
            "phase": "Failed",
            "reason": "UnexpectedAdmissionError",
            "message": "Allocate failed due to no GPU with room, which is unexpected",
        }
    )
    assert view.finished
    assert view.failure == (
        "UnexpectedAdmissionError: Allocate failed due to no GPU with room, which is unexpected"
    )


def test_a_failed_pod_without_a_reason_reads_back_with_its_containers_termination() -> None:
    killed = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    view = _read_back(
        {"phase": "Failed", "containerStatuses": [{"name": "engine", "state": killed}]}
    )
    assert view.failure == "container engine: OOMKilled, exit code 137"
    assert _read_back({"phase": "Running"}).failure == ""


def test_a_container_the_kubelet_keeps_restarting_reads_back_as_crash_looping() -> None:
    engine = {
        "name": "engine",
        "restartCount": 6,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s"}},
        "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": "x" * 5000}},
    }
    view = _read_back({"phase": "Running", "containerStatuses": [engine]})
    assert view.crash_looping.startswith("container engine: Error, exit code 1: xxx")
    assert len(view.crash_looping) <= 300  # a 4 KiB termination log is cut short
    assert not view.finished


def test_an_image_that_cannot_be_pulled_is_why_the_pod_is_not_ready() -> None:
    waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "vllm:x"'}
    view = _read_back(
        {
            "phase": "Pending",
            "containerStatuses": [{"name": "engine", "state": {"waiting": waiting}}],
        }
    )
    assert view.message == 'container engine: ImagePullBackOff: Back-off pulling image "vllm:x"'
    assert view.crash_looping == ""
