"""The one table of engine versions kvshare serves, and the patch module for each.

Everything that names supported versions reads :data:`SUPPORTED`: the operator (which
refuses a ModelServer whose image runs another version), the runtime's start-up refusal
and patch lookup (:mod:`kvshare.runtime.engines.registry`), the test environments' pins
(``make engines``) and the support table in docs/engines.md. Standard library only: the runtime
bundle imports it inside engine images.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SUPPORTED",
    "EngineName",
    "SupportedLine",
    "UnsupportedEngineVersionError",
    "find_line",
    "is_supported",
    "markdown_table",
    "parse_release",
    "supported_labels",
]

EngineName = Literal["vllm", "sglang"]

#: The engines kvshare hooks, by distribution (and top-level import) name.
ENGINES: tuple[EngineName, ...] = ("vllm", "sglang")

_RELEASE = re.compile(r"^v?(\d+(?:\.\d+)*)")


class UnsupportedEngineVersionError(RuntimeError):
    """The engine in this process is a version kvshare has no patches for."""


def parse_release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.33.1+cu130"`` -> ``(0, 33, 1)``.

    Pre-, post- and local parts are ignored: a line covers its post-releases and local
    builds. Raises :class:`ValueError` for a string without a leading release number.
    """
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a version number")
    return tuple(int(part) for part in match.group(1).split("."))


@dataclass(frozen=True)
class SupportedLine:
    """A range of one engine's releases that one patch module serves."""

    engine: EngineName
    first: str
    """Lowest release of the line (inclusive)."""
    below: str
    """First release that is no longer part of the line (exclusive)."""
    patch_module: str
    """Module under :mod:`kvshare.runtime.engines` with the patches for this line."""
    tested: str
    """The exact release the test environment installs (``make engines``)."""
    ownership: Literal["local", "coordinated"]
    """Who maps a tensor-parallel group's pages (DESIGN §2)."""
    memory_flags: tuple[str, ...] = ()
    """Flags the operator adds to the engine's command line so that its own memory
    sizing stays out of the way of kvshare's pool (vLLM 0.34: its extensible KV cache,
    which would reserve the KV memory itself and claim the whole GPU)."""

    def covers(self, version: str) -> bool:
        """Whether ``version`` belongs to this line."""
        release = _padded(parse_release(version))
        return _padded(parse_release(self.first)) <= release < _padded(parse_release(self.below))

    @property
    def label(self) -> str:
        """``0.33.x`` for a line of patch releases, else ``first`` to ``below``."""
        first, below = parse_release(self.first), parse_release(self.below)
        if len(first) == 3 and first[2] == 0 and below[:2] == (first[0], first[1] + 1):
            return f"{first[0]}.{first[1]}.x"
        if len(below) == 3 and below[:2] == first[:2] and below[2] == first[2] + 1:
            return self.first
        return f">= {self.first}, < {self.below}"

    @property
    def environment(self) -> str:
        """Name of the test environment that holds :attr:`tested` (``vllm-0.33.0``)."""
        return f"{self.engine}-{self.tested}"


def _padded(release: tuple[int, ...]) -> tuple[int, ...]:
    return release + (0,) * (4 - len(release))


#: Every supported engine line, newest first within an engine.
SUPPORTED: tuple[SupportedLine, ...] = (
    SupportedLine(
        "vllm",
        "0.34.0",
        "0.35",
        "vllm_v0_34",
        "0.34.0",
        "coordinated",
        memory_flags=("--no-enable-extensible-kv-cache",),
    ),
    SupportedLine("vllm", "0.33.0", "0.34", "vllm_v0_33", "0.33.0", "coordinated"),
    SupportedLine("vllm", "0.32.0", "0.33", "vllm_v0_32", "0.32.0", "coordinated"),
    SupportedLine("vllm", "0.30.0", "0.31", "vllm_v0_30", "0.30.0", "coordinated"),
    SupportedLine("sglang", "0.5.23", "0.5.24", "sglang_v0_5_23", "0.5.23", "local"),
    SupportedLine("sglang", "0.5.20", "0.5.21", "sglang_v0_5_20", "0.5.20", "local"),
)


def supported_labels(engine: str) -> str:
    """The supported lines of ``engine`` as one phrase (``0.33.x, 0.32.x, 0.30.x``)."""
    return ", ".join(line.label for line in SUPPORTED if line.engine == engine)


def is_supported(engine: str, version: str) -> bool:
    """Whether kvshare has patches for ``engine`` at ``version``."""
    try:
        find_line(engine, version)
    except UnsupportedEngineVersionError:
        return False
    return True


def find_line(engine: str, version: str) -> SupportedLine:
    """The line serving ``engine`` at ``version``.

    Raises :class:`UnsupportedEngineVersionError` naming the supported lines when there is
    none, so the engine refuses to start instead of serving without kvshare.
    """
    if engine not in ENGINES:
        raise UnsupportedEngineVersionError(
            f"kvshare has no hooks for the engine {engine!r}; it supports {', '.join(ENGINES)}"
        )
    try:
        release = parse_release(version)
    except ValueError:
        release = ()
    for line in SUPPORTED:
        if line.engine == engine and release and line.covers(version):
            return line
    raise UnsupportedEngineVersionError(
        f"{engine} {version} is not supported by kvshare; supported {engine} versions: "
        f"{supported_labels(engine)}. Use a supported engine image, or unset "
        "KVSHARE_ENABLE to run it without kvshare."
    )


def markdown_table() -> str:
    """The support table of docs/engines.md, generated from :data:`SUPPORTED`."""
    rows = [
        "| engine | versions | tested with | TP ownership | patch module |",
        "|---|---|---|---|---|",
    ]
    for line in SUPPORTED:
        rows.append(
            f"| {line.engine} | {line.label} | {line.tested} | {line.ownership} | "
            f"`kvshare.runtime.engines.{line.patch_module}` |"
        )
    return "\n".join(rows)
