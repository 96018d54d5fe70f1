"""What keeps a ModelServer from being served: a spec that does not validate, a name too
long for its pods and Service, an engine version kvshare does not support, and
co-location rules that name ModelServers that do not exist; and what is served other than
asked: a KV priority above what an administrator granted its namespace, capped."""

from __future__ import annotations

from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import EngineVersionError, ModelServerSpec
from kvshare.api.priorities import PriorityCeilings
from kvshare.operator.caches import Caches
from kvshare.operator.status import Problem
from kvshare.operator.views import ModelServerRef

__all__ = [
    "MAX_NAME_LENGTH",
    "cap_priority",
    "missing_refs",
    "names_in_colocation_rules",
    "raw_replicas",
    "validate_modelserver",
]

#: Longest ModelServer name: pod "<name>-<replica>" (replica < 1024) and the Service
#: named after it must stay valid DNS labels (63 characters).
MAX_NAME_LENGTH = 58


def validate_modelserver(ms: ModelServerRef) -> tuple[ModelServerSpec | None, Problem | None]:
    """The spec, or the problem that keeps it from being served."""
    try:
        spec = validate(ModelServerSpec, ms.spec, kind="ModelServer spec")
    except SpecError as exc:
        return None, Problem("InvalidSpec", "; ".join(exc.problems))
    if len(ms.name) > MAX_NAME_LENGTH:
        return spec, Problem(
            "NameTooLong",
            f"the name has {len(ms.name)} characters; at most {MAX_NAME_LENGTH} fit in the "
            "names of its pods and Service: recreate it with a shorter name",
        )
    try:
        spec.engine_version_resolved()
    except EngineVersionError as exc:
        return spec, Problem("UnsupportedEngineVersion", str(exc))
    return spec, None


def cap_priority(
    ms: ModelServerRef, spec: ModelServerSpec, ceilings: PriorityCeilings
) -> tuple[ModelServerSpec, str]:
    """``spec`` with its KV priority no higher than its namespace's ceiling, and what was
    capped ("" when nothing was). The admission policy refuses such a spec where it runs;
    this catches what got past it (a cluster without ValidatingAdmissionPolicy, a ceiling
    lowered later), so no pod runs above the ceiling."""
    ceiling = ceilings.ceiling(ms.namespace)
    asked = spec.kv_cache.priority
    if asked <= ceiling:
        return spec, ""
    capped = spec.model_copy(
        update={"kv_cache": spec.kv_cache.model_copy(update={"priority": ceiling})}
    )
    return capped, (
        f"kvCache.priority {asked} is above {ceiling}, the most namespace {ms.namespace} "
        f"may use: its replicas run at {ceiling} (an administrator grants more in the "
        "chart's kvPriority)"
    )


def missing_refs(ms: ModelServerRef, spec: ModelServerSpec, caches: Caches) -> dict[str, list[str]]:
    """The ModelServers ``spec``'s colocation rules name that do not exist, by field."""
    missing = {}
    for field, named in (
        ("colocateWith", spec.colocate_with),
        ("avoidColocationWith", spec.avoid_colocation_with),
    ):
        absent = []
        for name in named:
            other = caches.modelserver((ms.namespace, name))
            if other is None or other.deleting:
                absent.append(name)
        if absent:
            missing[field] = absent
    return missing


def names_in_colocation_rules(ms: ModelServerRef) -> set[str]:
    """The ModelServers the raw spec's colocation rules name (whether it validates or not)."""
    named: set[str] = set()
    for field in ("colocateWith", "avoidColocationWith"):
        value = ms.spec.get(field)
        if isinstance(value, list):
            named.update(n for n in value if isinstance(n, str))
    return named


def raw_replicas(ms: ModelServerRef) -> int:
    """The replica count of a spec that did not validate, when it is readable at all."""
    replicas = ms.spec.get("replicas", 1)
    return replicas if isinstance(replicas, int) and replicas >= 0 else 0
