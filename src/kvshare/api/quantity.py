"""Kubernetes resource quantities as exact byte counts.

Memory sizes cross every boundary in kvshare (CRDs, env vars, wire messages, CLI flags)
as Kubernetes quantities: ``40Gi``, ``512Mi``, ``1.5G``, ``1e9`` or plain bytes. This
module parses them into an ``int`` number of bytes *exactly* (no floating point) and
prints a byte count back as the shortest exact quantity, so ``format_bytes(parse_bytes(q))``
always denotes the same number of bytes as ``q``.

Grammar (from ``k8s.io/apimachinery/pkg/api/resource``)::

    quantity  ::= sign? digits ('.' digits?)? suffix?  |  sign? '.' digits suffix?
    suffix    ::= binarySI | decimalSI | decimalExponent
    binarySI  ::= Ki | Mi | Gi | Ti | Pi | Ei
    decimalSI ::= n | u | m | "" | k | M | G | T | P | E
    exponent  ::= (e | E) sign? digits
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "QUANTITY_PATTERN",
    "QuantityError",
    "QuantityTooLargeError",
    "format_bytes",
    "format_bytes_human",
    "parse_bytes",
    "parse_quantity",
]

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"^(?P<sign>[+-])?(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?[0-9]+)|(?P<decimal>[numkMGTPE])?)$"
)
# Exponents beyond this are never a memory size and would make Fraction arithmetic slow.
_MAX_EXPONENT = 30

# Suffixes tried when printing, largest first; binary before decimal at equal rank so
# that GPU-style sizes (2 MiB pages, 80 GiB cards) print the way people write them.
_PRINT_SUFFIXES: list[tuple[str, int]] = sorted(
    [*_BINARY.items(), *((s, int(f)) for s, f in _DECIMAL.items() if f >= 1 and s)],
    key=lambda item: item[1],
    reverse=True,
)

#: The pattern that CRD schemas use for quantity strings (kept in step with the parser).
QUANTITY_PATTERN = (
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)((Ki|Mi|Gi|Ti|Pi|Ei)|([eE][+-]?[0-9]+)|([numkMGTPE])?)$"
)


class QuantityError(ValueError):
    """A quantity string that is not a valid Kubernetes quantity, or not a byte count."""


class QuantityTooLargeError(QuantityError):
    """A valid quantity far beyond any memory size (``1e400``): not worth computing."""


def parse_quantity(text: str | int) -> Fraction:
    """Parse a Kubernetes quantity into an exact rational number.

    Raises :class:`QuantityError` with a message naming the offending text.
    """
    if isinstance(text, bool):
        raise QuantityError(f"{text!r} is not a quantity (expected e.g. 40Gi, 512Mi or 1e9)")
    if isinstance(text, int):
        return Fraction(text)
    if not isinstance(text, str):
        raise QuantityError(f"{text!r} is not a quantity (expected a string such as 40Gi)")
    stripped = text.strip()
    match = _QUANTITY.match(stripped)
    if match is None:
        raise QuantityError(
            f"{text!r} is not a valid quantity: expected a number with an optional suffix "
            "(Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E, m) or exponent, e.g. 40Gi, 512Mi, 1.5G"
        )
    value = Fraction(match["number"] if not match["number"].endswith(".") else match["number"][:-1])
    if match["binary"]:
        value *= _BINARY[match["binary"]]
    elif match["exp"]:
        exponent = int(match["exp"][1:])
        if exponent > _MAX_EXPONENT and value:
            raise QuantityTooLargeError(f"{text!r} is larger than any memory size")
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{text!r}: exponent {exponent} is out of range")
        value *= Fraction(10) ** exponent
    else:
        value *= _DECIMAL[match["decimal"] or ""]
    return -value if match["sign"] == "-" else value


def parse_bytes(text: str | int, *, field: str = "quantity") -> int:
    """Parse a memory size into a whole, non-negative number of bytes.

    ``field`` names the setting in error messages (``kvCache.min``, ``--headroom``...).
    """
    try:
        value = parse_quantity(text)
    except QuantityError as exc:
        raise type(exc)(f"{field}: {exc}") from None
    if value < 0:
        raise QuantityError(f"{field}: {text!r} is negative; a memory size must be >= 0")
    if value.denominator != 1:
        raise QuantityError(
            f"{field}: {text!r} is not a whole number of bytes ({float(value)} bytes)"
        )
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """Print a byte count as the shortest exact quantity (``42949672960`` -> ``40Gi``).

    Falls back to a plain integer when no suffix divides the count exactly, so the
    result always parses back to the same number of bytes.
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
        raise QuantityError(f"{num_bytes!r} is not a byte count (an int)")
    if num_bytes < 0:
        return "-" + format_bytes(-num_bytes)
    if num_bytes == 0:
        return "0"
    for suffix, factor in _PRINT_SUFFIXES:
        if num_bytes % factor == 0:
            return f"{num_bytes // factor}{suffix}"
    return str(num_bytes)


def format_bytes_human(num_bytes: int) -> str:
    """Print a byte count for people (rounded, binary units): ``1.5Gi``, ``37.2Mi``."""
    value = float(num_bytes)
    for suffix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(value) < 1024 or suffix == "Ti":
            return f"{value:.0f}{suffix}" if suffix == "" else f"{value:.1f}{suffix}"
        value /= 1024
    raise AssertionError("unreachable")
