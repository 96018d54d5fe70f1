"""Building blocks of the kvshare custom resources.

- :class:`KubeModel`: the base of every CR model (camelCase wire names, unknown fields
  refused, attribute docstrings become the CRD's field descriptions for `kubectl explain`).
- :data:`ByteQuantity`: a memory size, an ``int`` of bytes in Python and a Kubernetes
  quantity (``40Gi``) on the wire; :data:`WorkerMemory`, the same for the sizes users
  write, bounded, and refused at ``kubectl apply`` in words rather than with a pattern.
- :class:`CelRule` and :func:`cel_rules`: cross-field rules, written once as the CEL the
  API server runs at ``kubectl apply``; the models check the same rule in Python.
- Shapes borrowed from core Kubernetes (conditions, tolerations, env vars, resources).
- :class:`SpecError` and :func:`validate`: parse a raw object into a model, with errors a
  user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

from kvshare.api.names import MAX_WORKER_MEMORY_BYTES
from kvshare.api.quantity import (
    QUANTITY_PATTERN,
    QuantityError,
    QuantityTooLargeError,
    format_bytes,
    parse_bytes,
)

__all__ = [
    "DNS_SUBDOMAIN_PATTERN",
    "ByteQuantity",
    "CelRule",
    "Condition",
    "EnvVar",
    "KubeModel",
    "LocalObjectReference",
    "ResourceRequirements",
    "SpecError",
    "Toleration",
    "WorkerMemory",
    "cel_rules",
    "validate",
]


class KubeModel(BaseModel):
    """Base of every custom-resource model: camelCase names, no unknown fields, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, quantities as strings."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _parse_quantity_field(value: object) -> int:
    if isinstance(value, int | str):
        return parse_bytes(value)
    raise ValueError(f"{value!r} is not a quantity (expected e.g. 40Gi, 512Mi or 1e9)")


_AS_QUANTITY = PlainSerializer(format_bytes, return_type=str, when_used="json")
_INT_OR_STRING = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}

#: A memory size: ``int`` bytes in Python, a Kubernetes quantity on the wire.
ByteQuantity = Annotated[
    int,
    BeforeValidator(_parse_quantity_field),
    _AS_QUANTITY,
    WithJsonSchema({**_INT_OR_STRING, "pattern": QUANTITY_PATTERN}),
]


@dataclass(frozen=True)
class CelRule:
    """A CEL validation rule as the CRD carries it in ``x-kubernetes-validations``."""

    rule: str
    message_expression: str
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired"] = (
        "FieldValueInvalid"
    )

    def to_schema(self) -> dict[str, str]:
        """The rule as an ``x-kubernetes-validations`` entry."""
        entry = {
            "rule": self.rule,
            "messageExpression": self.message_expression,
            "reason": self.reason,
        }
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def cel_rules(*rules: CelRule) -> dict[str, Any]:
    """``json_schema_extra`` for a model whose schema carries ``rules``."""
    return {"x-kubernetes-validations": [rule.to_schema() for rule in rules]}


#: What a memory size looks like, for people (the API server and the models say the same).
NOT_A_MEMORY_SIZE = (
    "is not a memory size: write a whole number of bytes, optionally with a unit (Ki, Mi, "
    "Gi, Ti or k, M, G, T) or an exponent, e.g. 40Gi, 512Mi, 18G or 2e10"
)
TOO_LARGE = (
    f"is more than {format_bytes(MAX_WORKER_MEMORY_BYTES)}, the most one worker may ask for "
    "(no GPU has more memory)"
)


def _parse_worker_memory(value: object) -> int:
    shown = value if isinstance(value, int | str) and not isinstance(value, bool) else repr(value)
    try:
        size = parse_bytes(value)  # type: ignore[arg-type]
    except QuantityTooLargeError:
        size = MAX_WORKER_MEMORY_BYTES + 1
    except QuantityError:
        raise ValueError(f"{shown} {NOT_A_MEMORY_SIZE}") from None
    if size > MAX_WORKER_MEMORY_BYTES:
        raise ValueError(f"{shown} {TOO_LARGE}")
    return size


def _worker_memory_rules() -> dict[str, Any]:
    quantity = "quantity(string(self))"
    most = f"quantity('{format_bytes(MAX_WORKER_MEMORY_BYTES)}')"
    return cel_rules(
        CelRule(
            # Too large is the next rule's finding, not this one's.
            rule=f"isQuantity(string(self)) && ({quantity}.compareTo({most}) > 0 || "
            f"({quantity}.sign() >= 0 && {quantity}.isInteger()))",
            message_expression=f"string(self) + ' {NOT_A_MEMORY_SIZE}'",
        ),
        CelRule(
            rule=f"!isQuantity(string(self)) || {quantity}.compareTo({most}) <= 0",
            message_expression=f"string(self) + ' {TOO_LARGE}'",
        ),
    )


#: GPU memory a user asks for per worker (``staticMemory``, ``kvCache``): a
#: :data:`ByteQuantity` of at most :data:`~kvshare.api.names.MAX_WORKER_MEMORY_BYTES`,
#: checked in the same words by the API server at ``kubectl apply`` (CEL rules, so a
#: malformed size is explained with examples rather than a pattern) and by the model.
WorkerMemory = Annotated[
    int,
    BeforeValidator(_parse_worker_memory),
    _AS_QUANTITY,
    WithJsonSchema({**_INT_OR_STRING, "maxLength": 64, **_worker_memory_rules()}),
]


# --- shapes borrowed from core Kubernetes ----------------------------------------------


class Condition(KubeModel):
    """A condition in the Kubernetes convention (metav1.Condition)."""

    type: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9]*$", max_length=316)
    """Condition type, e.g. Placed, Ready, Progressing, Degraded."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    """One CamelCase word a program can match on."""
    message: str = Field(default="", max_length=32768)
    """What happened and what to do about it, for people."""
    last_transition_time: str
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation the condition was computed from."""


class Toleration(KubeModel):
    """A toleration of a node taint (core/v1 Toleration)."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key the toleration applies to; empty with operator Exists matches every key."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists matches any value; Equal matches `value`."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value to match when the operator is Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """How long a NoExecute taint is tolerated before eviction."""


class EnvVar(KubeModel):
    """An environment variable for the engine container (value or valueFrom)."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


#: A Kubernetes object name (RFC 1123 subdomain), as names of Secrets and ServiceAccounts are.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class LocalObjectReference(KubeModel):
    """A reference to an object in the same namespace by name (core/v1 LocalObjectReference)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Name of the object."""


class ResourceRequirements(KubeModel):
    """CPU and host memory for the engine container; kvshare adds the GPU resources."""

    requests: dict[str, int | str] = Field(
        default={},
        json_schema_extra={
            "additionalProperties": {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
            }
        },
    )
    """Requested resources (cpu, memory, ephemeral-storage)."""
    limits: dict[str, int | str] = Field(
        default={},
        json_schema_extra={
            "additionalProperties": {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
            }
        },
    )
    """Resource limits (cpu, memory, ephemeral-storage)."""


# --- validation errors people can act on ---------------------------------------------


class SpecError(ValueError):
    """An object that does not satisfy its schema; ``problems`` lists each finding."""

    def __init__(self, kind: str, problems: list[str]) -> None:
        self.kind = kind
        self.problems = problems
        super().__init__(f"invalid {kind}: " + "; ".join(problems))


M = TypeVar("M", bound=BaseModel)


def _location(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith(("function-", "constrained-", "int", "str", "literal[")):
            path += f".{part}" if path else part
    return path


def _problem(error: Any) -> str:
    message = str(error["msg"])
    # Our own validators already phrase the whole finding; pydantic prefixes them.
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    where = _location(tuple(error["loc"]))
    if error["type"] == "missing":
        return f"{where} is required"
    if error["type"] == "extra_forbidden":
        return f"{where} is not a known field"
    return f"{where}: {message}" if where else message


def validate(model: type[M], obj: object, *, kind: str | None = None) -> M:
    """Parse ``obj`` into ``model``, or raise :class:`SpecError` listing every problem."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        problems = [_problem(error) for error in exc.errors(include_url=False)]
        raise SpecError(kind or model.__name__, problems) from None
