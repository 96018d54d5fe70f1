"""What a ModelServer spec may not put into its engine container: the environment
variables that choose GPUs or configure kvshare, and the engine flags that size memory.

A spec is written by a tenant. Where NVIDIA's container toolkit takes
``NVIDIA_VISIBLE_DEVICES`` from a container's environment (its default for unprivileged
containers), a spec setting it to ``all`` would see every GPU of the node, whatever the
device plugin allocated; ``CUDA_VISIBLE_DEVICES`` would renumber what the runtime hands the
engine; a ``CUDA_MPS_*`` variable would join another tenant's MPS server; ``KVSHARE_*``
variables are the pool's identity and policy, set by the operator and the device plugin.
Flags that size the engine's memory (``--gpu-memory-utilization``, ...) are the kvshare
runtime's to set from the lease; flags kvshare sets (model, port, tensor parallelism) are
its own. Both are refused at admission by CEL rules of the CRD (:func:`env_rule`,
:func:`engine_args_rule`) and again by the operator (:func:`env_problems`,
:func:`managed_args`), with messages that name what was refused.

Engines read their flags with Python's ``argparse``, which takes any unambiguous prefix of
a flag (``--gpu-memory-util``) and, in vLLM, ``_`` for ``-``: a flag is refused when,
cut at ``=`` and with ``_`` read as ``-``, it is a prefix of a managed flag.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvshare.api.kube import CelRule

__all__ = [
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "engine_args_rule",
    "env_problems",
    "env_rule",
    "managed_args",
    "reserved_env",
]

#: Variables that choose the GPUs a container sees (NVIDIA's, CUDA's, and AMD's for
#: completeness), and engine settings that size the KV cache outside kvshare's lease.
RESERVED_ENV_NAMES: tuple[str, ...] = (
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
)
#: Families of variables: NVIDIA's container toolkit (``NVIDIA_VISIBLE_DEVICES``,
#: ``NVIDIA_DRIVER_CAPABILITIES``, MIG settings), CUDA MPS, and kvshare's own.
RESERVED_ENV_PREFIXES: tuple[str, ...] = ("NVIDIA_", "CUDA_MPS_", "KVSHARE_")


def reserved_env(name: str) -> bool:
    """Whether a spec may not set variable ``name``."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


#: Part of a CEL string literal too: no quotes.
_ENV_WHY = (
    "they choose the GPUs the container sees or configure kvshare and the engine memory, "
    "which kvshare sets from the GPUs allocated and the lease"
)


def env_problems(names: Iterable[str]) -> list[str]:
    """One problem per variable of ``names`` a spec may not set."""
    refused = sorted({n for n in names if reserved_env(n)})
    if not refused:
        return []
    return [
        f"env may not set {', '.join(refused)}: {', '.join(RESERVED_ENV_NAMES)} and "
        f"variables starting with {', '.join(RESERVED_ENV_PREFIXES)} are refused ({_ENV_WHY})"
    ]


def env_rule() -> CelRule:
    """The CRD's rule on ``spec.env`` (a list of ``{name, value, valueFrom}``)."""
    names = ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES)
    prefixes = " || ".join(f"e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
    test = f"e.name in [{names}] || {prefixes}"
    return CelRule(
        rule=f"!self.exists(e, {test})",
        message_expression=(
            f"'env may not set ' + self.filter(e, {test}).map(e, e.name).join(', ') + ': "
            f"{', '.join(RESERVED_ENV_NAMES)} and variables starting with "
            f"{', '.join(RESERVED_ENV_PREFIXES)} are refused ({_ENV_WHY})'"
        ),
        reason="FieldValueForbidden",
    )


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0].replace("_", "-")


def managed_args(args: Iterable[str], flags: Sequence[str]) -> list[str]:
    """The arguments of ``args`` that set (or abbreviate) one of ``flags``."""
    return [
        arg
        for arg in args
        if arg.startswith("-") and any(f.startswith(_flag_name(arg)) for f in flags)
    ]


def engine_args_rule(flags: Sequence[str]) -> CelRule:
    """The CRD's rule on ``spec.engineArgs`` refusing ``flags`` however spelt."""
    listed = ", ".join(f"'{f}'" for f in flags)
    name = "(a.indexOf('=') >= 0 ? a.substring(0, a.indexOf('=')) : a).replace('_', '-')"
    test = f"a.startsWith('-') && [{listed}].exists(f, f.startsWith({name}))"
    return CelRule(
        rule=f"!self.exists(a, {test})",
        message_expression=(
            f"'engineArgs may not set flags kvshare manages (' + self.filter(a, {test})"
            f".join(', ') + '): they set or abbreviate one of {', '.join(flags)}; use the "
            "ModelServer fields instead'"
        ),
        reason="FieldValueForbidden",
    )
