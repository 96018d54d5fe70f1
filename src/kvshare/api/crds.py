"""CustomResourceDefinitions generated from the models — the one source of truth.

The pydantic models in :mod:`kvshare.api.modelserver` and :mod:`kvshare.api.kvsharenode`
describe every field once (type, bounds, default, docstring); this module turns their
JSON schema into a *structural* OpenAPI v3 schema as ``apiextensions.k8s.io/v1`` wants
it: references inlined, every node typed, optional fields plain, CEL rules carried in
``x-kubernetes-validations``. ``kvshare crds`` prints the result and the Helm chart ships
a copy that a test keeps identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from kvshare.api import names
from kvshare.api.kvsharenode import KVShareNodeSpec, KVShareNodeStatus
from kvshare.api.modelserver import ModelServerSpec, ModelServerStatus

__all__ = ["all_crds", "crds_yaml", "openapi_schema"]

# JSON-schema keywords with no place in a Kubernetes structural schema.
_DROPPED_KEYS = {"title", "$defs", "$ref"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve ``$ref`` and flatten pydantic's JSON schema into a structural schema."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    any_of = node.get("anyOf")
    if any_of and {"type": "null"} in any_of:
        # Optional[X]: an absent field, not a nullable one; drop the null branch.
        rest = [branch for branch in any_of if branch != {"type": "null"}]
        flattened = {k: v for k, v in node.items() if k != "anyOf"}
        flattened.pop("default", None)
        if len(rest) == 1:
            flattened = {**rest[0], **flattened}
        else:
            flattened["anyOf"] = rest
        return _inline(flattened, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "additionalProperties" and isinstance(value, bool):
            # Structural schemas prune unknown fields (false) or keep them with
            # x-kubernetes-preserve-unknown-fields (true); a boolean here is refused.
            continue
        if key == "description":
            out[key] = " ".join(value.split())
            continue
        if key == "properties":
            out[key] = {name: _inline(prop, defs) for name, prop in value.items()}
        else:
            out[key] = _inline(value, defs)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out.setdefault("properties", {})
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of ``model`` (camelCase field names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return dict(_inline(raw, raw.get("$defs", {})))


@dataclass(frozen=True)
class _Kind:
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    scope: str
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[tuple[str, str, str, str], ...]  # name, type, jsonPath, description
    description: str
    scale: dict[str, str] | None = None
    """The scale subresource's paths (``kubectl scale``, HorizontalPodAutoscaler, KEDA)."""


_KINDS = (
    _Kind(
        kind=names.MODELSERVER_KIND,
        plural=names.MODELSERVER_PLURAL,
        singular=names.MODELSERVER_SINGULAR,
        short_names=names.MODELSERVER_SHORT_NAMES,
        scope="Namespaced",
        spec=ModelServerSpec,
        status=ModelServerStatus,
        columns=(
            ("Phase", "string", ".status.phase", "Lifecycle phase"),
            ("Ready", "string", ".status.ready", "Ready over desired replicas"),
            ("Engine", "string", ".spec.engine", "Serving engine"),
            ("Model", "string", ".spec.model", "Served model"),
            ("KV Used", "string", ".status.kv.used", "KV bytes holding live blocks"),
            ("KV Limit", "string", ".status.kv.lease", "KV bytes currently leased"),
            ("Age", "date", ".metadata.creationTimestamp", ""),
        ),
        description="A model served by vLLM or SGLang on GPUs shared elastically by kvshare.",
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    ),
    _Kind(
        kind=names.KVSHARENODE_KIND,
        plural=names.KVSHARENODE_PLURAL,
        singular=names.KVSHARENODE_SINGULAR,
        short_names=names.KVSHARENODE_SHORT_NAMES,
        scope="Cluster",
        spec=KVShareNodeSpec,
        status=KVShareNodeStatus,
        columns=(
            ("GPUs", "integer", ".status.gpuCount", "GPUs on the node"),
            ("Pools", "integer", ".status.poolCount", "KV pools on the node"),
            ("Free", "string", ".status.free", "Memory placement may still commit"),
            ("Backend", "string", ".status.backend", "cuda, or host for fake GPUs"),
            ("Config", "string", ".status.nodeConfig", "Node-agent configuration it runs"),
            ("Age", "date", ".metadata.creationTimestamp", ""),
        ),
        description="GPU capacity and KV pools of one node, published by its kvshare node agent.",
    ),
)


def _crd(kind: _Kind) -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": kind.description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(kind.spec),
            "status": openapi_schema(kind.status),
        },
        "required": ["spec"],
    }
    columns = []
    for name, column_type, path, description in kind.columns:
        column = {"name": name, "type": column_type, "jsonPath": path}
        if description:
            column["description"] = description
        columns.append(column)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kind.plural}.{names.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvshare"},
        },
        "spec": {
            "group": names.GROUP,
            "scope": kind.scope,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": [names.CATEGORY],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        **({"scale": dict(kind.scale)} if kind.scale else {}),
                    },
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def all_crds() -> list[dict[str, Any]]:
    """Both CRDs as objects: ModelServer, then KVShareNode."""
    return [_crd(kind) for kind in _KINDS]


def crds_yaml() -> str:
    """Both CRDs as one multi-document YAML stream (what ``kvshare crds`` prints)."""
    header = "# Generated by `kvshare crds` from kvshare.api; do not edit by hand.\n"
    return header + yaml.safe_dump_all(all_crds(), sort_keys=False, width=100)
