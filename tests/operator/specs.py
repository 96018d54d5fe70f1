"""ModelServers and pods for the operator's tests."""

from __future__ import annotations

from typing import Any

from kvshare.api import names
from kvshare.api.kube import validate
from kvshare.api.modelserver import ModelServerSpec
from kvshare.operator.views import ModelServerRef, PodView

GIB = 2**30
NAMESPACE = "llm"


def spec_body(**overrides: Any) -> dict[str, Any]:
    """A valid ModelServer spec as stored (camelCase), with ``overrides``."""
    body: dict[str, Any] = {
        "engine": "vllm",
        "image": "vllm/vllm-openai:v0.33.0",
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "replicas": 1,
        "staticMemory": "18Gi",
        "kvCache": {"min": "4Gi", "max": "40Gi", "priority": 200},
    }
    body.update(overrides)
    return body


def modelserver(name: str = "qwen", namespace: str = NAMESPACE, **overrides: Any) -> dict[str, Any]:
    """A ModelServer object to create."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.MODELSERVER_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec_body(**overrides),
    }


def parsed(**overrides: Any) -> ModelServerSpec:
    return validate(ModelServerSpec, spec_body(**overrides))


def ref(name: str = "qwen", namespace: str = NAMESPACE, **overrides: Any) -> ModelServerRef:
    return ModelServerRef(
        namespace=namespace,
        name=name,
        uid=f"uid-{name}",
        generation=1,
        spec=spec_body(**overrides),
        status={},
    )


def pod(
    replica: int,
    *,
    ms: str = "qwen",
    node: str = "node-a",
    gpus: tuple[str, ...] = ("GPU-a0",),
    per_gpu: int = 22 * GIB,
    template: str = "h1",
    ready: bool = True,
    phase: str = "Running",
    terminating: bool = False,
    namespace: str = NAMESPACE,
    gpu_memory_units: int | None = None,
) -> PodView:
    """A replica pod; its GPU-memory request covers ``per_gpu`` on each of its GPUs unless
    ``gpu_memory_units`` says otherwise."""
    return PodView(
        namespace=namespace,
        name=f"{ms}-{replica}",
        uid=f"uid-{ms}-{replica}-{template}",
        modelserver=ms,
        replica=replica,
        template_hash=template,
        node=node,
        gpus=gpus,
        per_gpu_bytes=per_gpu,
        gpu_memory_units=(
            gpu_memory_units if gpu_memory_units is not None else len(gpus) * -(-per_gpu // GIB)
        ),
        phase=phase,
        ready=ready,
        terminating=terminating,
    )
