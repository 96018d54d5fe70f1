"""KV priorities an administrator grants: the highest ``kvCache.priority`` each namespace
may use.

Priority decides who gives memory back first, so a team that could set its own would
take 1000 and win every contention. The chart's ``kvPriority`` value names a ceiling for
every namespace (``default``) and higher or lower ones for some (``namespaces``); it is
rendered three times from one source, and each reads it with this module:

- a ConfigMap (:func:`to_configmap_data`) that a ``ValidatingAdmissionPolicy`` reads to
  refuse a ModelServer above its namespace's ceiling at admission;
- the operator's flags (:func:`parse_flags`), so that a ModelServer that got past
  admission (a cluster without the policy) is capped, visibly;
- the node agent's flags, so that a pool declaring a priority above its (verified)
  namespace's ceiling runs at the ceiling.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "CONFIGMAP_DEFAULT_KEY",
    "CONFIGMAP_NAMESPACE_PREFIX",
    "MAX_PRIORITY",
    "PriorityCeilings",
    "PriorityError",
]

#: The highest priority a ModelServer may ask for at all (the CRD's bound).
MAX_PRIORITY = 1000
#: ConfigMap key of the ceiling of every namespace not named.
CONFIGMAP_DEFAULT_KEY = "default"
#: ConfigMap keys of the namespaces' own ceilings: ``namespace.<name>`` (a namespace may be
#: called ``default``).
CONFIGMAP_NAMESPACE_PREFIX = "namespace."


class PriorityError(ValueError):
    """A ceiling that cannot be read; the message names it."""


def _ceiling(text: str | int, what: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise PriorityError(f"{what}: {text!r} is not an integer") from None
    if not 0 <= value <= MAX_PRIORITY:
        raise PriorityError(f"{what}: {value} is outside 0-{MAX_PRIORITY}")
    return value


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)


def _namespace(name: str) -> str:
    if not _NAMESPACE.fullmatch(name):
        raise PriorityError(f"namespace {name!r} is not a namespace name (a DNS label)")
    return name


@dataclass(frozen=True)
class PriorityCeilings:
    """The highest KV priority of each namespace; 1000 everywhere unless told."""

    default: int = MAX_PRIORITY
    namespaces: Mapping[str, int] = field(default_factory=dict)

    def ceiling(self, namespace: str) -> int:
        """The highest priority ``namespace`` may use."""
        return self.namespaces.get(namespace, self.default)

    @classmethod
    def parse_flags(cls, default: int | str, pairs: Iterable[str]) -> PriorityCeilings:
        """From ``--kv-priority-default N`` and ``--kv-priority NAMESPACE=N`` flags."""
        namespaces = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep:
                raise PriorityError(f"--kv-priority {pair!r}: expected NAMESPACE=PRIORITY")
            namespaces[_namespace(name)] = _ceiling(value, f"--kv-priority {name}")
        return cls(_ceiling(default, "--kv-priority-default"), namespaces)

    def to_flags(self) -> list[str]:
        """The flags :meth:`parse_flags` reads back."""
        return [f"--kv-priority-default={self.default}"] + [
            f"--kv-priority={name}={value}" for name, value in sorted(self.namespaces.items())
        ]

    def to_configmap_data(self) -> dict[str, str]:
        """The ConfigMap data the admission policy reads."""
        data = {CONFIGMAP_DEFAULT_KEY: str(self.default)}
        for name, value in sorted(self.namespaces.items()):
            data[CONFIGMAP_NAMESPACE_PREFIX + name] = str(value)
        return data
