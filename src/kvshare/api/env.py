"""Every environment variable kvshare reads: name, default, meaning, and its one parser.

This module is the only place in kvshare that reads the process environment. Code asks
for a setting with ``env.KV_MIN.read()``; the table in docs/configuration.md is generated
from :data:`ALL` (``make docs``) and a test keeps the two in step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from kvshare.api import names
from kvshare.api.quantity import QuantityError, parse_bytes

T_co = TypeVar("T_co", covariant=True)

Audience = Literal["runtime", "node", "operator", "all"]


class EnvError(ValueError):
    """An environment variable is set to a value kvshare cannot use."""


@dataclass(frozen=True)
class EnvVar(Generic[T_co]):
    """One environment variable: how it is parsed, its default, and what it means."""

    name: str
    default: str | None
    meaning: str
    parse: Callable[[str], T_co]
    audience: Audience

    def read(self, environ: Mapping[str, str] | None = None) -> T_co | None:
        """Return the parsed value, the parsed default, or ``None`` when unset and no default.

        Raises :class:`EnvError` naming the variable when the value does not parse.
        """
        source = os.environ if environ is None else environ
        raw = source.get(self.name)
        if raw is None or raw == "":
            raw = self.default
        if raw is None:
            return None
        try:
            return self.parse(raw)
        except (ValueError, QuantityError) as exc:
            raise EnvError(f"{self.name}={raw!r}: {exc} ({self.meaning})") from None

    def require(self, environ: Mapping[str, str] | None = None) -> T_co:
        """Like :meth:`read`, but a missing value is an :class:`EnvError`."""
        value = self.read(environ)
        if value is None:
            raise EnvError(f"{self.name} is not set ({self.meaning})")
        return value

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable is present and non-empty (its default does not count)."""
        source = os.environ if environ is None else environ
        return bool(source.get(self.name))


def _flag(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _bytes(raw: str) -> int:
    return parse_bytes(raw, field="value")


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a number of seconds > 0")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw

    return parse


def _text(raw: str) -> str:
    return raw


ENABLE = EnvVar(
    "KVSHARE_ENABLE",
    "0",
    "1 activates the engine hooks in a model-server process (set by the operator)",
    _flag,
    "runtime",
)
BACKEND = EnvVar(
    "KVSHARE_BACKEND",
    "auto",
    "virtual-memory backend of the KV pool: cuda, host, or auto (cuda when a driver answers; "
    "host only where the container has no GPU, else start-up stops naming what it found)",
    _choice("auto", "cuda", "host"),
    "runtime",
)
BROKER_SOCKET = EnvVar(
    "KVSHARE_BROKER_SOCKET",
    f"{names.RUN_DIR}/{names.BROKER_SOCKET_NAME}",
    "unix socket of the node agent's memory broker",
    _text,
    "all",
)
KV_MIN = EnvVar(
    "KVSHARE_KV_MIN",
    "0",
    "KV cache bytes guaranteed to this worker (kvCache.min)",
    _bytes,
    "runtime",
)
KV_MAX = EnvVar(
    "KVSHARE_KV_MAX",
    None,
    "cap on this worker's KV cache bytes (kvCache.max); unset = the pool's virtual size",
    _bytes,
    "runtime",
)
KV_CAPACITY = EnvVar(
    "KVSHARE_KV_CAPACITY",
    None,
    "largest KV cache (bytes) this worker can grow to without a restart: the pool's virtual "
    "size, up to which kvCache.max can be raised in place (set by the operator from the "
    "GPU); unset = KVSHARE_KV_MAX, else the device's memory less the static footprint",
    _bytes,
    "runtime",
)
KV_PRIORITY = EnvVar(
    "KVSHARE_KV_PRIORITY",
    "100",
    "reclaim priority (0-1000): lower priorities give memory back first under contention",
    _non_negative_int,
    "runtime",
)
KV_LIMIT = EnvVar(
    "KVSHARE_KV_LIMIT",
    None,
    "fixed KV lease in bytes for standalone use without a node agent",
    _bytes,
    "runtime",
)
STATIC_BYTES = EnvVar(
    "KVSHARE_STATIC_BYTES",
    "0",
    "this worker's static GPU footprint (weights, activations, CUDA context) in bytes",
    _bytes,
    "runtime",
)
PAGE_SIZE = EnvVar(
    "KVSHARE_PAGE_SIZE",
    "2Mi",
    "physical page size of the KV pool (a multiple of the backend's granularity)",
    _bytes,
    "runtime",
)
LAYOUT = EnvVar(
    "KVSHARE_LAYOUT",
    "auto",
    "what one KV page holds: auto (whole blocks of every layer where vLLM's attention "
    "backends and the model allow a block-outer KV layout, else one page per layer, the "
    "reason logged and in /metrics), block-outer (that, or start-up fails saying why) or "
    "per-layer (vLLM's own layout preference; SGLang is always per-layer)",
    _choice("auto", "block-outer", "per-layer"),
    "runtime",
)
RESERVE_PAGES = EnvVar(
    "KVSHARE_RESERVE_PAGES",
    None,
    "physical pages kept created ahead of demand so allocation rarely waits (unset: the "
    "pages that hold 4 KV blocks: 4 pages of one block, 1 page of 8)",
    _non_negative_int,
    "runtime",
)
LEASE_CHUNK = EnvVar(
    "KVSHARE_LEASE_CHUNK",
    None,
    "lease an engine's pool asks the broker for at a time (its growth step; unset: 32Mi); "
    "a larger step sends fewer messages and leaves more memory idle with each growing pool",
    _bytes,
    "runtime",
)
STARTUP_TIMEOUT = EnvVar(
    "KVSHARE_STARTUP_TIMEOUT",
    "600",
    "seconds an engine waits for its GPU's start-up turn from the broker",
    _positive_seconds,
    "runtime",
)
POD_NAMESPACE = EnvVar(
    "KVSHARE_POD_NAMESPACE", None, "namespace of this pod (downward API)", _text, "runtime"
)
POD_NAME = EnvVar("KVSHARE_POD_NAME", None, "name of this pod (downward API)", _text, "runtime")
POD_UID = EnvVar("KVSHARE_POD_UID", None, "uid of this pod (downward API)", _text, "runtime")
MODELSERVER = EnvVar(
    "KVSHARE_MODELSERVER", None, "the ModelServer this pod serves", _text, "runtime"
)
GPU_UUIDS = EnvVar(
    "KVSHARE_GPU_UUIDS",
    None,
    "comma-separated UUIDs of the GPUs allocated to this container, in rank order",
    _text,
    "runtime",
)
IMAGE = EnvVar(
    "KVSHARE_IMAGE",
    None,
    "kvshare image whose runtime bundle the operator copies into model-server pods "
    "(its init container); the operator's --image flag overrides it",
    _text,
    "operator",
)
LOG_LEVEL = EnvVar(
    "KVSHARE_LOG_LEVEL",
    "INFO",
    "log level of kvshare's loggers",
    _choice("DEBUG", "INFO", "WARNING", "ERROR"),
    "all",
)

#: Every variable, in the order docs/configuration.md lists them.
ALL: tuple[EnvVar[object], ...] = (
    ENABLE,
    BACKEND,
    BROKER_SOCKET,
    KV_MIN,
    KV_MAX,
    KV_CAPACITY,
    KV_PRIORITY,
    KV_LIMIT,
    STATIC_BYTES,
    PAGE_SIZE,
    LAYOUT,
    RESERVE_PAGES,
    LEASE_CHUNK,
    STARTUP_TIMEOUT,
    POD_NAMESPACE,
    POD_NAME,
    POD_UID,
    MODELSERVER,
    GPU_UUIDS,
    IMAGE,
    LOG_LEVEL,
)


def configured(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kvshare variables that are set (non-empty), by name, as text: what a process
    hands on to a child that must see the same kvshare settings."""
    source = os.environ if environ is None else environ
    return {var.name: source[var.name] for var in ALL if source.get(var.name)}


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the container runtime or the user set it (never kvshare).

    Read only to tell a GPU container from a CPU one; not one of kvshare's settings, so it
    is not in :data:`ALL`.
    """
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def markdown_table() -> str:
    """The configuration reference of docs/configuration.md, generated from :data:`ALL`."""
    rows = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for var in ALL:
        default = f"`{var.default}`" if var.default is not None else "unset"
        rows.append(f"| `{var.name}` | {default} | {var.audience} | {var.meaning} |")
    return "\n".join(rows)
