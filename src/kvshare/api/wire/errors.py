"""The wire protocol's one error, and how an error message may quote what a peer sent."""

from __future__ import annotations

import json
from typing import Literal

__all__ = ["ErrorKind", "ProtocolError", "shown"]

ErrorKind = Literal["frame", "json", "message", "identity"]


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol; the connection carrying it is closed.

    ``kind`` says which rule it broke, for counting: ``frame`` (size), ``json`` (not one
    JSON object, repeated keys, nested too deeply), ``message`` (types, fields, numbers,
    text, or the order of the conversation), ``identity`` (a name outside its syntax).
    """

    def __init__(self, message: str, kind: ErrorKind = "message") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


def shown(value: object) -> str:
    """``value`` as an error message may quote it: escaped, and cut to a few dozen
    characters (a peer's value must never reach a log or terminal raw)."""
    if isinstance(value, str):
        text = ascii(value[:48])
        return text if len(value) <= 48 else f"{text[:-1]}...' ({len(value)} characters)"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        digits = len(str(abs(value)))
        return str(value) if digits <= 24 else f"an integer of {digits} digits"
    if isinstance(value, float):
        return repr(value)
    return "a list" if isinstance(value, list) else "an object"
