"""The generated CRDs are valid apiextensions/v1 objects with structural schemas, and
they accept and refuse the same ModelServers as the Python models, with the same words."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvshare.api.crds import all_crds, crds_yaml
from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import ModelServerSpec
from tests.k8s_schema import admit, structural_problems

ROOT = Path(__file__).resolve().parents[2]
MODELSERVER_CRD, KVSHARENODE_CRD = all_crds()


def readme_modelservers() -> list[dict[str, Any]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    docs = [yaml.safe_load(block) for block in blocks]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "ModelServer"]


def example_modelservers() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]


def qwen_example() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "examples" / "qwen-7b-vllm.yaml").read_text()))


@pytest.mark.parametrize("crd", all_crds(), ids=lambda c: c["metadata"]["name"])
@pytest.mark.parametrize("version", ["1.30", "1.31", "1.32", "1.33", "1.34"])
def test_crd_is_a_valid_apiextensions_v1_object(crd: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(crd, version, strict=True)


@pytest.mark.parametrize("crd", all_crds(), ids=lambda c: c["metadata"]["name"])
def test_crd_schema_is_structural(crd: dict[str, Any]) -> None:
    (version,) = crd["spec"]["versions"]
    assert structural_problems(version["schema"]["openAPIV3Schema"]) == []
    assert version["subresources"]["status"] == {}


def test_modelserver_scales_through_its_replicas_and_pod_selector() -> None:
    (version,) = MODELSERVER_CRD["spec"]["versions"]
    scale = version["subresources"]["scale"]
    schema = version["schema"]["openAPIV3Schema"]

    def field(path: str) -> dict[str, Any]:
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        return dict(node)

    assert field(scale["specReplicasPath"])["type"] == "integer"
    assert field(scale["statusReplicasPath"])["type"] == "integer"
    assert field(scale["labelSelectorPath"])["type"] == "string"
    (kvsharenode,) = KVSHARENODE_CRD["spec"]["versions"]
    assert "scale" not in kvsharenode["subresources"]


def test_crds_print_as_two_yaml_documents() -> None:
    docs = [d for d in yaml.safe_load_all(crds_yaml()) if d]
    assert [d["spec"]["names"]["kind"] for d in docs] == ["ModelServer", "KVShareNode"]
    assert docs[0]["spec"]["names"]["shortNames"] == ["ms"]
    assert docs[1]["spec"]["scope"] == "Cluster"


def test_printer_columns_point_at_fields_the_schema_has() -> None:
    for crd in all_crds():
        (version,) = crd["spec"]["versions"]
        schema = version["schema"]["openAPIV3Schema"]
        for column in version["additionalPrinterColumns"]:
            node = schema
            for part in column["jsonPath"].strip(".").split("."):
                if part == "metadata":
                    break
                node = node["properties"][part]


def test_readme_and_examples_are_accepted_by_the_crd_and_the_model() -> None:
    objects = readme_modelservers() + example_modelservers()
    assert len(readme_modelservers()) >= 1
    for obj in objects:
        assert admit(MODELSERVER_CRD, obj) == []
        validate(ModelServerSpec, obj["spec"])


def _with(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()

# (change to the example, what the API server says, what the Python model says)
INVALID = [
    (
        ("spec.kvCache", {"min": "50Gi", "max": "40Gi"}),
        "kvCache.min (50Gi) exceeds kvCache.max (40Gi)",
        "kvCache: kvCache.min (50Gi) exceeds kvCache.max (40Gi)",
    ),
    (
        ("spec.staticMemory", _DELETE),
        "set staticMemory (GPU memory per worker for weights and activations, e.g. 18Gi) or "
        "modelParameters (e.g. 8B) so kvshare can place the model",
        "set staticMemory",
    ),
    (
        ("spec.engineArgs", ["--tensor-parallel-size=2"]),
        "engineArgs may not set flags kvshare manages",
        "engineArgs may not set flags kvshare manages (--tensor-parallel-size=2)",
    ),
    (("spec.engine", "tgi"), "spec.engine: 'tgi' is not one of ['vllm', 'sglang']", "engine: "),
    (("spec.tensorParallelSize", 3), "spec.tensorParallelSize: 3 is not one of", "tensorParallel"),
    (
        ("spec.staticMemory", "18GB"),
        "18GB is not a memory size: write a whole number of bytes, optionally with a unit (Ki, "
        "Mi, Gi, Ti or k, M, G, T) or an exponent, e.g. 40Gi, 512Mi, 18G or 2e10",
        "staticMemory: 18GB is not a memory size: write a whole number of bytes",
    ),
    (("spec.staticMemory", "-18Gi"), "-18Gi is not a memory size", "staticMemory: -18Gi is not"),
    (("spec.staticMemory", "1500m"), "1500m is not a memory size", "staticMemory: 1500m is not"),
    (
        ("spec.kvCache", {"min": "4Gi", "max": "10Pi"}),
        "10Pi is more than 1Ti, the most one worker may ask for (no GPU has more memory)",
        "kvCache.max: 10Pi is more than 1Ti, the most one worker may ask for",
    ),
    (("spec.kvCache", {"min": "1e400"}), "1e400 is more than 1Ti", "kvCache.min: 1e400 is more"),
    (("spec.staticMemory", "1" * 65), "spec.staticMemory: '111", "staticMemory: 111"),
    *(
        (
            ("spec.image", image),
            "must be a container image reference such as vllm/vllm-openai:v0.33.0 or "
            "registry.example.com:5000/team/vllm@sha256:<digest>",
            "image: must be a container image reference",
        )
        for image in [
            "vllm/vllm-openai:v0.33.0\n",
            "vllm/vllm-openai:v0.33.0\x1b[2J",
            "vllm/vllm-\u043epenai:v0.33.0",  # a Cyrillic o
            "vllm/vllm-openai:v0.33.0 --privileged",
            "Vllm/vllm-openai",
            "vllm/vllm-openai:",
        ]
    ),
    (("spec.replicas", -1), "spec.replicas: -1 is less than the minimum of 0", "replicas: "),
    (
        ("spec.podLabels", {"team": "a", "kvshare.io/replica": "7"}),
        "podLabels may not set keys under kvshare.io/ or app.kubernetes.io/managed-by: kvshare "
        "sets them on its pods and finds the pods by them; use other keys",
        "podLabels may not set kvshare.io/replica",
    ),
    (
        ("spec.podLabels", {"app.kubernetes.io/managed-by": "argocd"}),
        "podLabels may not set keys under kvshare.io/ or app.kubernetes.io/managed-by",
        "podLabels may not set app.kubernetes.io/managed-by",
    ),
    (
        ("spec.podAnnotations", {"kvshare.io/gpus": "GPU-0"}),
        "podAnnotations may not set keys under kvshare.io/: kvshare sets them",
        "podAnnotations may not set kvshare.io/gpus",
    ),
    (
        ("spec.podLabels", {f"l{i}": "x" for i in range(65)}),
        "spec.podLabels: {",
        "podLabels: Dictionary should have at most 64 items",
    ),
    (
        ("spec.podAnnotations", {"note": "x" * 4097}),
        "spec.podAnnotations.note: 'xxx",
        "podAnnotations.note: String should have at most 4096 characters",
    ),
    (
        ("spec.imagePullSecrets", [{"name": "Registry_Credentials"}]),
        "spec.imagePullSecrets.0.name: 'Registry_Credentials' does not match",
        "imagePullSecrets[0].name: String should match pattern",
    ),
    (
        ("spec.serviceAccountName", "Model Reader"),
        "spec.serviceAccountName: 'Model Reader' does not match",
        "serviceAccountName: String should match pattern",
    ),
]


@pytest.mark.parametrize(("change", "server_says", "model_says"), INVALID)
def test_invalid_modelservers_fail_in_the_crd_and_the_model_alike(
    change: tuple[str, Any], server_says: str, model_says: str
) -> None:
    obj = _with(qwen_example(), *change)
    found = admit(MODELSERVER_CRD, obj)
    assert len(found) == 1 and found[0].startswith(server_says), found
    with pytest.raises(SpecError) as info:
        validate(ModelServerSpec, obj["spec"])
    assert any(p.startswith(model_says) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    "image",
    [
        "vllm/vllm-openai",
        "localhost:5000/vllm:latest",
        "nvcr.io/nvidia/tritonserver:24.01-py3",
        "lmsysorg/sglang:v0.5.23-cu126",
        "registry.example.com:5000/team/my_vllm@sha256:" + "0a" * 32,
        "ghcr.io/org/vllm:v0.33.0@sha256:" + "f" * 64,
    ],
)
def test_image_references_in_every_usual_form_are_accepted(image: str) -> None:
    obj = _with(qwen_example(), "spec.image", image)
    assert admit(MODELSERVER_CRD, obj) == []
    validate(ModelServerSpec, obj["spec"])


def test_a_modelserver_with_engine_image_model_and_static_memory_only_is_accepted() -> None:
    obj = qwen_example()
    obj["spec"] = {key: obj["spec"][key] for key in ("engine", "image", "model", "staticMemory")}
    assert admit(MODELSERVER_CRD, obj) == []
    spec = validate(ModelServerSpec, obj["spec"])
    assert spec.kv_cache.min == 0 and spec.kv_cache.max is None and spec.kv_cache.priority == 100


def test_cel_rule_accepts_min_equal_to_max_in_different_units() -> None:
    obj = _with(qwen_example(), "spec.kvCache", {"min": "1Gi", "max": 2**30})
    assert admit(MODELSERVER_CRD, obj) == []


def test_kvsharenode_example_status_is_accepted() -> None:
    node = {
        "apiVersion": "kvshare.io/v1alpha1",
        "kind": "KVShareNode",
        "metadata": {"name": "gpu-node-1"},
        "spec": {"nodeName": "gpu-node-1"},
        "status": {
            "backend": "host",
            "gpuCount": 1,
            "poolCount": 1,
            "free": "50Gi",
            "gpus": [
                {
                    "uuid": "GPU-0",
                    "index": 0,
                    "total": "80Gi",
                    "static": "20Gi",
                    "kvMin": "10Gi",
                    "free": "50Gi",
                    "pools": [{"namespace": "llm", "pod": "qwen-7b-0", "kvMin": "10Gi"}],
                }
            ],
        },
    }
    assert admit(KVSHARENODE_CRD, node) == []
