"""What the strings of a wire message may hold: every string field has a :class:`Syntax`,
checked as the message is decoded. Identities (GPU, namespace, pod, pod UID,
ModelServer, engine) must have the syntax Kubernetes or NVML gives them; every other
string is :data:`TEXT`: printable, without control characters, bounded in length."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from kvshare.api.wire.errors import ErrorKind, shown

__all__ = [
    "TEXT",
    "GpuId",
    "GroupName",
    "LabelValue",
    "LayoutReasonName",
    "Namespace",
    "ObjectName",
    "PageLayoutName",
    "Syntax",
    "Uid",
]


@dataclass(frozen=True, slots=True)
class Syntax:
    """What one string field may hold; checked on every message decoded.

    ``pattern`` (ASCII only, matched whole) is the syntax the value gets where it is
    made: Kubernetes for namespaces, pods and objects, NVML for GPU UUIDs. Without one,
    any printable text is allowed: no control, format or surrogate characters.
    ``optional`` allows the empty string (a name the pool does not know).
    """

    what: str
    max_length: int
    pattern: re.Pattern[str] | None = None
    optional: bool = False
    kind: ErrorKind = "identity"

    def problem(self, value: str) -> str | None:
        """Why ``value`` does not have this syntax, or ``None``."""
        if not value and self.optional:
            return None
        if len(value) > self.max_length:
            return f"{len(value)} characters, more than the {self.max_length} of {self.what}"
        if self.pattern is None:
            return None if value.isprintable() else f"{shown(value)} is not printable text"
        return None if self.pattern.fullmatch(value) else f"{shown(value)} is not {self.what}"


def _syntax(regex: str) -> re.Pattern[str]:
    return re.compile(regex, re.ASCII)


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"

#: Free text (reasons, errors, names the agent makes): printable, at most 4096 characters.
TEXT = Syntax("text", 4096, kind="message")
#: A GPU as NVML names it (``GPU-<uuid>``, ``MIG-<uuid>``, ``MIG-GPU-<uuid>/1/0``).
GpuId = Annotated[
    str,
    Syntax(
        "a GPU UUID (letters, digits and '-', '_', '.', ':', '/', at most 128)",
        128,
        _syntax(r"[A-Za-z0-9][-A-Za-z0-9_.:/]*"),
    ),
]
#: A Kubernetes namespace: a DNS label.
Namespace = Annotated[
    str,
    Syntax(
        "a Kubernetes namespace (a DNS label: lowercase letters, digits and '-', at most 63)",
        63,
        _syntax(_DNS_LABEL),
        optional=True,
    ),
]
#: A Kubernetes object name (pods, ModelServers): a DNS subdomain.
ObjectName = Annotated[
    str,
    Syntax(
        "a Kubernetes object name (a DNS subdomain: lowercase letters, digits, '-' and "
        "'.', at most 253)",
        253,
        _syntax(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"),
        optional=True,
    ),
]
#: A Kubernetes object UID.
Uid = Annotated[
    str,
    Syntax(
        "a Kubernetes UID (a UUID such as 0f8fad5b-d9cb-469f-a165-70867728950e)",
        36,
        _syntax(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        optional=True,
    ),
]
#: A tensor-parallel group's name, as the runtime makes it (``<pod uid>/<engine group>``).
GroupName = Annotated[
    str,
    Syntax(
        "a start-up group name (letters, digits and '-', '_', '.', '/', at most 128)",
        128,
        _syntax(r"[A-Za-z0-9][-A-Za-z0-9_./]*"),
        optional=True,
    ),
]
#: How a pool's pages hold the engine's blocks (``kvshare.runtime.paging``), or ``""``.
PageLayoutName = Annotated[
    str,
    Syntax(
        "a page layout (block-outer or per-layer)",
        16,
        _syntax(r"block-outer|per-layer"),
        optional=True,
        kind="message",
    ),
]
#: Why a pool keeps per-layer pages (``kvshare.runtime.paging.LAYOUT_REASONS``), or ``""``.
LayoutReasonName = Annotated[
    str,
    Syntax(
        "a page layout reason (setting, engine-setting, backend, model, connector, engine)",
        16,
        _syntax(r"setting|engine-setting|backend|model|connector|engine"),
        optional=True,
        kind="message",
    ),
]
#: A Kubernetes label value.
LabelValue = Annotated[
    str,
    Syntax(
        "a Kubernetes label value (letters, digits, '-', '_' and '.', at most 63)",
        63,
        _syntax(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"),
        optional=True,
    ),
]
