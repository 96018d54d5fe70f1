"""ModelServer specs validate with messages a user can act on."""

from __future__ import annotations

from typing import Any

import pytest

from kvshare.api.engines import is_supported
from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import (
    ENGINE_COMMAND_LINES,
    ENGINE_MANAGED_FLAGS,
    EngineVersionError,
    ModelServerSpec,
    image_tag_version,
)

GIB = 2**30


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "engine": "vllm",
        "image": "vllm/vllm-openai:v0.33.0",
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "staticMemory": "18Gi",
        "kvCache": {"min": "4Gi", "max": "40Gi"},
    }
    base.update(overrides)
    return base


def problems(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate(ModelServerSpec, obj, kind="ModelServer spec")
    return info.value.problems


def test_valid_spec_parses_quantities_and_applies_defaults() -> None:
    parsed = validate(ModelServerSpec, spec())
    assert parsed.static_memory == 18 * GIB
    assert parsed.kv_cache.min == 4 * GIB
    assert parsed.kv_cache.priority == 100
    assert parsed.replicas == 1
    assert parsed.placement_policy == "Binpack"
    assert parsed.to_wire()["kvCache"] == {"min": "4Gi", "max": "40Gi", "priority": 100}


def test_min_above_max_names_both_values() -> None:
    assert problems(spec(kvCache={"min": "50Gi", "max": "40Gi"})) == [
        "kvCache: kvCache.min (50Gi) exceeds kvCache.max (40Gi)"
    ]


def test_bad_quantity_names_the_field() -> None:
    found = problems(spec(kvCache={"min": "4GB"}))
    assert len(found) == 1
    assert found[0] == (
        "kvCache.min: 4GB is not a memory size: write a whole number of bytes, optionally "
        "with a unit (Ki, Mi, Gi, Ti or k, M, G, T) or an exponent, e.g. 40Gi, 512Mi, 18G or 2e10"
    )


def test_engine_image_model_and_static_memory_are_enough() -> None:
    minimal = {"engine": "vllm", "image": "vllm/vllm-openai:v0.33.0",
               "model": "Qwen/Qwen2.5-7B-Instruct", "staticMemory": "18Gi"}  # fmt: skip
    parsed = validate(ModelServerSpec, minimal)
    assert (parsed.kv_cache.min, parsed.kv_cache.max, parsed.kv_cache.priority) == (0, None, 100)


def test_missing_and_unknown_fields_are_listed_together() -> None:
    obj = spec(replicaz=2)
    del obj["image"]
    assert sorted(problems(obj)) == ["image is required", "replicaz is not a known field"]


def test_static_memory_or_parameters_is_required() -> None:
    obj = spec()
    del obj["staticMemory"]
    (found,) = problems(obj)
    assert "set staticMemory" in found and "modelParameters" in found


def test_static_memory_is_estimated_from_parameters() -> None:
    obj = spec(modelParameters="70B", tensorParallelSize=4)
    del obj["staticMemory"]
    parsed = validate(ModelServerSpec, obj)
    # 70e9 params x 2 bytes / 4 GPUs x 1.1 + 2 GiB, rounded up to MiB.
    expected = int(70e9 * 2 / 4 * 1.1) + 2 * GIB
    assert 0 <= parsed.static_bytes_per_worker() - expected < 2**20
    assert parsed.gpu_memory_units_per_replica() == 4 * -(
        -(parsed.static_bytes_per_worker() + 4 * GIB) // GIB
    )


def test_engine_args_may_not_override_managed_flags() -> None:
    (found,) = problems(
        spec(engineArgs=["--max-model-len", "8192", "--gpu-memory-utilization=0.9"])
    )
    assert found.startswith(
        "engineArgs may not set flags kvshare manages (--gpu-memory-utilization=0.9)"
    )


def test_resources_may_not_name_gpus() -> None:
    (found,) = problems(spec(resources={"limits": {"nvidia.com/gpu": 1}}))
    assert "resources may not name nvidia.com/gpu" in found


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"engine": "tgi"}, "engine: Input should be 'vllm' or 'sglang'"),
        ({"tensorParallelSize": 3}, "tensorParallelSize: Input should be 1, 2, 4 or 8"),
        ({"replicas": -1}, "replicas: Input should be greater than or equal to 0"),
        ({"port": 70000}, "port: Input should be less than or equal to 65535"),
        ({"kvCache": {"min": "1Gi", "priority": 5000}}, "kvCache.priority: Input should be less"),
        ({"colocateWith": ["a"], "avoidColocationWith": ["a"]}, "a cannot be both in colocateWith"),
        ({"colocateWith": ["Bad_Name"]}, "colocateWith[0]: String should match pattern"),
    ],
)
def test_field_rules_are_explained(override: dict[str, Any], expected: str) -> None:
    (found,) = problems(spec(**override))
    assert found.startswith(expected)


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("vllm/vllm-openai:v0.33.0", "0.33.0"),
        ("lmsysorg/sglang:v0.5.23-cu126", "0.5.23"),
        ("lmsysorg/sglang:0.5.23.post1", "0.5.23.post1"),
        ("registry:5000/team/vllm", None),
        ("vllm/vllm-openai@sha256:0123abcd", None),
        ("vllm/vllm-openai:latest", None),
    ],
)
def test_engine_version_is_read_from_the_image_tag(image: str, version: str | None) -> None:
    assert image_tag_version(image) == version


def test_supported_versions_match_by_whole_components() -> None:
    assert is_supported("vllm", "0.33.4")
    assert is_supported("vllm", "0.30.0")
    assert not is_supported("vllm", "0.331.0")
    assert is_supported("sglang", "0.5.23.post1")
    assert not is_supported("sglang", "0.5.2")
    assert not is_supported("sglang", "0.5.21")


def test_unknown_or_unsupported_versions_say_what_to_set() -> None:
    parsed = validate(ModelServerSpec, spec(image="vllm/vllm-openai:latest"))
    with pytest.raises(
        EngineVersionError,
        match=r"set spec.engineVersion \(supported: 0.34.x, 0.33.x, 0.32.x, 0.30.x\)",
    ):
        parsed.engine_version_resolved()
    parsed = validate(ModelServerSpec, spec(image="vllm/vllm-openai:v0.20.1"))
    with pytest.raises(EngineVersionError, match=r"vllm 0\.20\.1 is not supported"):
        parsed.engine_version_resolved()
    parsed = validate(ModelServerSpec, spec(image="my/vllm:latest", engineVersion="0.33.2"))
    assert parsed.engine_version_resolved() == "0.33.2"


def test_managed_flags_come_from_the_engine_command_lines() -> None:
    for engine, command in ENGINE_COMMAND_LINES.items():
        assert set(ENGINE_MANAGED_FLAGS[engine]) == set(command.managed_flags())
        argv = command.argv(model="m", port=1, tensor_parallel_size=1)[len(command.program) :]
        assert {a for a in argv if a.startswith("-")} <= set(command.managed_flags())


def test_pod_fields_parse_and_stay_out_of_the_wire_form_when_unset() -> None:
    parsed = validate(
        ModelServerSpec,
        spec(
            imagePullSecrets=[{"name": "registry-credentials"}],
            serviceAccountName="model-reader",
            podLabels={"team": "research", "example.com/cost-center": "ml-42"},
            podAnnotations={"sidecar.istio.io/inject": "true"},
        ),
    )
    assert [ref.name for ref in parsed.image_pull_secrets] == ["registry-credentials"]
    assert parsed.service_account_name == "model-reader"
    assert parsed.pod_labels == {"team": "research", "example.com/cost-center": "ml-42"}
    assert parsed.pod_annotations == {"sidecar.istio.io/inject": "true"}
    wire = validate(ModelServerSpec, spec()).model_dump(by_alias=True, exclude_defaults=True)
    assert not {"imagePullSecrets", "serviceAccountName", "podLabels", "podAnnotations"} & set(wire)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"podLabels": {"kvshare.io/modelserver": "other"}},
            "podLabels may not set kvshare.io/modelserver: kvshare sets keys under kvshare.io/ "
            "or app.kubernetes.io/managed-by on its pods and finds the pods by them",
        ),
        (
            {"podLabels": {"app.kubernetes.io/managed-by": "helm"}},
            "podLabels may not set app.kubernetes.io/managed-by: kvshare sets",
        ),
        (
            {"podAnnotations": {"kvshare.io/node": "gpu-node-9"}},
            "podAnnotations may not set kvshare.io/node: kvshare sets keys under kvshare.io/ on",
        ),
        (
            {"podLabels": {"team/": "x"}},
            "podLabels key 'team/' is not valid: its name '' must be 1-63 letters",
        ),
        (
            {"podAnnotations": {"Example.com/x": "y"}},
            "podAnnotations key 'Example.com/x' is not valid: its prefix 'Example.com' must be",
        ),
        ({"podLabels": {"team": "not valid"}}, "podLabels.team: String should match pattern"),
        ({"podLabels": {"team": "x" * 64}}, "podLabels.team: String should have at most 63"),
        ({"imagePullSecrets": [{"name": "Bad_Name"}]}, "imagePullSecrets[0].name: String should"),
        ({"imagePullSecrets": [{}]}, "imagePullSecrets[0].name is required"),
        ({"serviceAccountName": "-bad"}, "serviceAccountName: String should match pattern"),
    ],
)
def test_pod_fields_are_checked_with_messages_that_name_the_key(
    override: dict[str, Any], expected: str
) -> None:
    (found,) = problems(spec(**override))
    assert found.startswith(expected), found
