"""Namespace quotas: a pod refused for an exceeded ``ResourceQuota``, and when to try again.

Replica pods request ``kvshare.io/gpu`` and ``kvshare.io/gpu-memory``, so a quota on
``requests.kvshare.io/gpu-memory`` (or on slots, CPU, pods...) bounds what a namespace's
ModelServers commit. The API server's quota admission refuses a pod beyond it with HTTP
403 and a message in one fixed format (``k8s.io/apiserver``'s resourcequota plugin)::

    pods "qwen-2" is forbidden: exceeded quota: team-a, requested:
    requests.kvshare.io/gpu-memory=22, used: requests.kvshare.io/gpu-memory=44,
    limited: requests.kvshare.io/gpu-memory=48

:func:`quota_refusal` reads it into a :class:`QuotaRefusal`, which says in the status
which quota, what was asked and what is left. The operator then creates no more pods for
that ModelServer until the quota, as its watch shows it (:class:`QuotaView`), has changed
and has room for what was refused (:meth:`QuotaView.has_room`): freed by other pods, or
raised. Pure functions; the controller keeps the refusals.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvshare.api.quantity import QuantityError, parse_quantity

__all__ = ["QuotaRefusal", "QuotaView", "quota_refusal"]

_EXCEEDED = re.compile(
    r"exceeded quota: (?P<quota>[^,\s]+), requested: (?P<requested>\S+), "
    r"used: (?P<used>\S+), limited: (?P<limited>\S+)"
)


def _amounts(text: str) -> dict[str, str]:
    """``a=1,b=2Gi`` (the API server's list of resources and quantities) as a dict."""
    amounts = {}
    for item in text.split(","):
        resource, sep, quantity = item.partition("=")
        if sep:
            amounts[resource] = quantity
    return amounts


def _quantity(text: str) -> Fraction | None:
    try:
        return parse_quantity(text)
    except QuantityError:
        return None


def _format(value: Fraction, like: str) -> str:
    """``value`` in the unit of the quantity ``like`` when it is a whole number of them."""
    suffix = re.sub(r"^[0-9.]+", "", like)
    unit = _quantity(f"1{suffix}") if suffix else Fraction(1)
    if unit and (value / unit).denominator == 1:
        return f"{value / unit}{suffix}"
    return str(value.numerator // value.denominator if value.denominator == 1 else float(value))


@dataclass(frozen=True)
class QuotaRefusal:
    """A pod the API server refused because a namespace quota is exhausted."""

    quota: str
    """The ResourceQuota's name."""
    pod: str
    requested: Mapping[str, str] = field(default_factory=dict)
    """The exceeded resources (e.g. ``requests.kvshare.io/gpu-memory``) and what the pod
    asks of each."""
    used: Mapping[str, str] = field(default_factory=dict)
    limited: Mapping[str, str] = field(default_factory=dict)

    def left(self, resource: str) -> str:
        """What the quota still allows of ``resource`` (as the API server counted)."""
        limit, used = (
            _quantity(self.limited.get(resource, "")),
            _quantity(self.used.get(resource, "0")),
        )
        if limit is None or used is None:
            return "?"
        return _format(max(limit - used, Fraction(0)), self.limited[resource])

    def describe(self) -> str:
        """What was refused and why, and what to do, for the status and the Event."""
        shortfalls = "; ".join(
            f"{resource}: asks {asked}, {self.left(resource)} left of "
            f"{self.limited.get(resource, '?')}"
            for resource, asked in sorted(self.requested.items())
        )
        return (
            f"pod {self.pod} exceeds ResourceQuota {self.quota} ({shortfalls}); it is "
            "created when the quota has room: raise the quota, free it, or ask for less "
            "(replicas, kvCache.min, staticMemory, resources)"
        )


def quota_refusal(pod: str, status: int, message: str) -> QuotaRefusal | None:
    """The quota refusal an API error (``status``, ``message``) for ``pod`` is, if any."""
    if status != 403:
        return None
    match = _EXCEEDED.search(message)
    if match is None:
        return None
    return QuotaRefusal(
        quota=match["quota"],
        pod=pod,
        requested=_amounts(match["requested"]),
        used=_amounts(match["used"]),
        limited=_amounts(match["limited"]),
    )


@dataclass(frozen=True)
class QuotaView:
    """A ResourceQuota as its watch shows it: the hard limits and what is used."""

    namespace: str
    name: str
    hard: Mapping[str, str]
    used: Mapping[str, str]
    version: str = ""
    """``metadata.resourceVersion``: tells a changed quota from one that changed back."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> QuotaView:
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        # status.hard is what the quota controller enforces; spec.hard until it has run.
        hard = status.get("hard") or (body.get("spec") or {}).get("hard") or {}
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            hard={str(k): str(v) for k, v in hard.items()},
            used={str(k): str(v) for k, v in (status.get("used") or {}).items()},
            version=str(meta.get("resourceVersion") or ""),
        )

    def has_room(self, refusal: QuotaRefusal) -> bool:
        """Whether the pod ``refusal`` names would fit now (a limit gone counts as room;
        an unreadable one too, so that the API server decides)."""
        for resource, asked in refusal.requested.items():
            if resource not in self.hard:
                continue
            hard = _quantity(self.hard[resource])
            used = _quantity(self.used.get(resource, "0"))
            need = _quantity(asked)
            if hard is not None and used is not None and need is not None and used + need > hard:
                return False
        return True
