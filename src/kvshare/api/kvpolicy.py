"""A pod's KV-cache policy as it travels in place: ModelServer -> pod annotation -> node
agent -> broker, with no restart.

The operator writes a ModelServer's ``kvCache`` (``min``, ``max``, ``priority``) into each
replica pod's ``kvshare.io/kv-policy`` annotation (:func:`encode`); the node agent watches
its node's pods, reads the annotation back (:func:`decode`) and applies it to the pod's
pools as ``kvshare ctl set-max`` does. An annotation is writable by anyone who may patch
the pod, so :func:`decode` takes nothing on trust: bounded size, strict JSON, the CRD's own
bounds (quantities, priority 0-1000, min <= max), and the agent further refuses a minimum
the pod's GPU-memory request does not cover. Both sides name a policy by
:func:`revision`, so the KVShareNode can say which policy each pool runs under and the
ModelServer's status which replicas run the current one.
"""

from __future__ import annotations

import hashlib
import json

from kvshare.api.kube import SpecError, validate
from kvshare.api.modelserver import KVCacheSpec
from kvshare.api.quantity import format_bytes

__all__ = ["MAX_ANNOTATION_BYTES", "PolicyError", "decode", "describe", "encode", "revision"]

#: Longest annotation value read (a policy is under 80 bytes).
MAX_ANNOTATION_BYTES = 1024


class PolicyError(ValueError):
    """The annotation is not a KV policy kvshare can apply; the message says why."""


def encode(policy: KVCacheSpec) -> str:
    """The annotation value of ``policy`` (compact JSON, keys sorted, quantities as text)."""
    return json.dumps(policy.to_wire(), sort_keys=True, separators=(",", ":"))


def decode(text: str) -> KVCacheSpec:
    """The policy in annotation value ``text``; :class:`PolicyError` when it is not one."""
    if len(text.encode("utf-8", errors="replace")) > MAX_ANNOTATION_BYTES:
        raise PolicyError(f"longer than {MAX_ANNOTATION_BYTES} bytes")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PolicyError(f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise PolicyError('not a JSON object such as {"min":"4Gi","max":"40Gi","priority":200}')
    try:
        return validate(KVCacheSpec, document, kind="kvCache")
    except SpecError as exc:
        raise PolicyError("; ".join(exc.problems)) from None


def revision(kv_min: int, kv_max: int | None, priority: int) -> str:
    """A short name of a policy, the same for the operator and the node agent."""
    text = f"{kv_min}:{'' if kv_max is None else kv_max}:{priority}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def describe(policy: KVCacheSpec) -> str:
    """``min 4Gi, max 40Gi, priority 200``, for messages."""
    cap = "none" if policy.max is None else format_bytes(policy.max)
    return f"min {format_bytes(policy.min)}, max {cap}, priority {policy.priority}"
