"""No spec can widen the GPUs its container sees or size the engine's memory itself: the
CRD's CEL rules and the operator's validation refuse, with the same words naming what was
refused, the variables that choose GPUs or configure kvshare and the engine flags that
size memory, however they are spelt."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import ModelServerSpec
from kvshare.operator.validation import validate_modelserver
from kvshare.operator.views import ModelServerRef
from tests.api.test_crds import MODELSERVER_CRD, ROOT, qwen_example
from tests.k8s_schema import admit


def with_spec(**fields: Any) -> dict[str, Any]:
    obj = copy.deepcopy(qwen_example())
    obj["spec"].update(fields)
    return obj


def refusals(obj: dict[str, Any]) -> tuple[list[str], list[str], str]:
    """What the API server says, what the model says, what the operator says."""
    server = admit(MODELSERVER_CRD, obj)
    with pytest.raises(SpecError) as info:
        validate(ModelServerSpec, obj["spec"])
    _, problem = validate_modelserver(ModelServerRef.from_body(obj))
    assert problem is not None and problem.reason == "InvalidSpec"
    return server, list(info.value.problems), problem.message


@pytest.mark.parametrize(
    "env",
    [
        [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        [{"name": "HF_TOKEN", "value": "x"}, {"name": "CUDA_VISIBLE_DEVICES", "value": "0,1"}],
        [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}],
        [{"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/other-team"}],
        [{"name": "KVSHARE_KV_PRIORITY", "value": "1000"}],
        [{"name": "KVSHARE_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
    ],
    ids=lambda env: env[-1]["name"],
)
def test_a_spec_setting_a_gpu_or_kvshare_variable_is_refused_naming_it(
    env: list[dict[str, Any]],
) -> None:
    name = env[-1]["name"]
    server, model, operator = refusals(with_spec(env=env))
    assert len(server) == 1 and server[0].startswith(f"env may not set {name}: "), server
    assert any(p.startswith(f"env may not set {name}: ") for p in model), model
    assert f"env may not set {name}: " in operator  # the ModelServer's InvalidSpec condition


def test_ordinary_variables_pass() -> None:
    obj = with_spec(env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf",
                                                                            "key": "t"}}},
                         {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])  # fmt: skip
    assert admit(MODELSERVER_CRD, obj) == []
    validate(ModelServerSpec, obj["spec"])


@pytest.mark.parametrize(
    "arg",
    [
        "--gpu-memory-utilization=0.99",
        "--gpu-memory-util=0.99",  # argparse takes an unambiguous prefix
        "--gpu_memory_utilization=0.99",  # vLLM reads _ as -
        "--kv-cache-memory-bytes=80G",
        "--kv-cache-memory=80G",
        "--mem-fraction-static=0.9",
        "--mem-frac",
        "--tensor-parallel-size",
    ],
)
def test_an_engine_flag_that_sizes_memory_is_refused_however_spelt(arg: str) -> None:
    server, model, operator = refusals(with_spec(engineArgs=["--max-model-len", "8192", arg]))
    words = f"engineArgs may not set flags kvshare manages ({arg}): "
    assert len(server) == 1 and server[0].startswith(words), server
    assert any(p.startswith(words) for p in model), model
    assert words in operator


@pytest.mark.parametrize(
    "args", [["--max-model-len", "8192"], ["--kv-cache-dtype", "fp8"], ["--max-num-seqs=64"]]
)
def test_ordinary_engine_flags_pass(args: list[str]) -> None:
    obj = with_spec(engineArgs=args)
    assert admit(MODELSERVER_CRD, obj) == []
    validate(ModelServerSpec, obj["spec"])


def test_the_shipped_crd_carries_the_rules() -> None:
    text = (ROOT / "charts" / "kvshare" / "crds" / "kvshare.io.yaml").read_text()
    crd = next(d for d in yaml.safe_load_all(text) if d["spec"]["names"]["kind"] == "ModelServer")
    obj = with_spec(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    assert admit(crd, obj)[0].startswith("env may not set NVIDIA_VISIBLE_DEVICES")
