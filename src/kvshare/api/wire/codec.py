"""Encoding and strict decoding of typed JSON messages: a :class:`Message` is a frozen
dataclass with a unique ``TYPE``; a :class:`Codec` encodes one family of them into frames
and decodes a frame's payload into one of them, checking every value on the way.

Decoding is the one gate for what a peer sends: an unknown type, a missing, unknown or
repeated field, a value of the wrong type, nesting deeper than :data:`MAX_NESTING`, an
integer outside 64 bits, a number that is not finite, or a string outside its field's
:class:`~kvshare.api.wire.syntax.Syntax` is a
:class:`~kvshare.api.wire.errors.ProtocolError`."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, TypeVar, Union

from kvshare.api.wire.errors import ProtocolError, shown
from kvshare.api.wire.framing import MAX_FRAME_BYTES, encode_frame
from kvshare.api.wire.syntax import TEXT, Syntax

__all__ = ["MAX_NESTING", "Codec", "Message"]

#: Deepest nesting of JSON objects and lists a message may have (an admin reply has 4).
MAX_NESTING = 8

_INT64 = range(-(2**63), 2**63)


class Message:
    """Base of every wire message: a frozen dataclass with a unique ``TYPE`` name."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""


M = TypeVar("M", bound=Message)


#: Plain JSON types: hint -> (accepted Python types, what to call them in an error).
_PLAIN: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    bool: ((bool,), "true or false"),
    str: ((str,), "a string"),
}


def _checker(hint: Any, where: str) -> typing.Callable[[Any], Any]:
    """A function that validates (and converts) one decoded JSON value against ``hint``."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *extras = typing.get_args(hint)
        syntaxes = [e for e in extras if isinstance(e, Syntax)]
        if base is not str or len(syntaxes) != 1:
            raise TypeError(f"{where}: only Annotated[str, Syntax(...)] is supported")
        return _string_checker(syntaxes[0], where)
    if hint is str:
        return _string_checker(TEXT, where)
    if hint in _PLAIN:
        accepted, expected = _PLAIN[hint]

        def check_plain(value: Any) -> Any:
            # Exact types: JSON true is not an integer, 1.0 is not a count of bytes.
            if type(value) not in accepted:
                raise ProtocolError(f"{where}: expected {expected}, got {shown(value)}")
            if type(value) is int and value not in _INT64:
                raise ProtocolError(f"{where}: {shown(value)} does not fit in 64 bits")
            if type(value) is float and not math.isfinite(value):
                raise ProtocolError(f"{where}: expected a finite number, got {value!r}")
            return hint(value)

        return check_plain
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"{where}: only X | None unions are supported")
        check_inner = _checker(inner[0], where)

        def check_optional(value: Any) -> Any:
            return None if value is None else check_inner(value)

        return check_optional
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        check_item = _checker(item, f"{where}[]")

        def check_list(value: Any) -> Any:
            if type(value) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            items = [check_item(v) for v in value]
            return tuple(items) if origin is tuple else items

        return check_list
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        build = _builder(hint)

        def check_nested(value: Any) -> Any:
            if type(value) is not dict:
                raise ProtocolError(f"{where}: expected an object, got {shown(value)}")
            return build(value)

        return check_nested
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def _string_checker(syntax: Syntax, where: str) -> typing.Callable[[Any], Any]:
    def check_string(value: Any) -> Any:
        if type(value) is not str:
            raise ProtocolError(f"{where}: expected a string, got {shown(value)}")
        problem = syntax.problem(value)
        if problem is not None:
            raise ProtocolError(f"{where}: {problem}", syntax.kind)
        return value

    return check_string


def _builder(cls: type[Any]) -> typing.Callable[[dict[str, Any]], Any]:
    """A function that builds ``cls`` from a decoded JSON object, strictly."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    checks = {f.name: _checker(hints[f.name], f"{cls.__name__}.{f.name}") for f in fields}
    required = frozenset(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )

    def build(data: dict[str, Any]) -> Any:
        unknown = data.keys() - checks.keys()
        if unknown:
            listed = ", ".join(shown(name) for name in sorted(unknown)[:8])
            raise ProtocolError(f"{cls.__name__}: unknown fields [{listed}]")
        missing = required - data.keys()
        if missing:
            raise ProtocolError(f"{cls.__name__}: missing fields {sorted(missing)}")
        return cls(**{name: checks[name](value) for name, value in data.items()})

    return build


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class Codec:
    """Encodes and strictly decodes one family of message types."""

    def __init__(
        self, message_types: Iterable[type[Message]], max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        #: Largest payload this codec encodes, and its peers should read.
        self.max_frame_bytes = max_frame_bytes
        self._builders: dict[str, typing.Callable[[dict[str, Any]], Any]] = {}
        self._fields: dict[type[Message], tuple[str, ...]] = {}
        for cls in message_types:
            if not cls.TYPE or cls.TYPE in self._builders:
                raise TypeError(f"{cls.__name__}: message TYPE missing or used twice")
            self._builders[cls.TYPE] = _builder(cls)
            self._fields[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def encode(self, message: Message) -> bytes:
        """One complete frame (header and payload) carrying ``message``."""
        names = self._fields.get(type(message))
        if names is None:
            raise TypeError(f"{type(message).__name__} is not a message of this codec")
        body: dict[str, Any] = {"type": message.TYPE}
        for name in names:
            body[name] = _plain(getattr(message, name))
        return encode_frame(json.dumps(body, separators=(",", ":")).encode(), self.max_frame_bytes)

    def decode(self, payload: bytes) -> Message:
        """The message in one frame's payload; :class:`ProtocolError` when it is not one."""
        try:
            # Strict UTF-8 first: json.loads would also take UTF-16 and UTF-32 bytes.
            data = json.loads(payload.decode("utf-8"), object_pairs_hook=_object)
        except RecursionError:
            raise ProtocolError(_TOO_DEEP, "json") from None
        except ProtocolError:
            raise
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"frame is not a JSON object: {exc}", "json") from None
        if type(data) is not dict:
            raise ProtocolError("frame is not a JSON object", "json")
        if _nesting(data) > MAX_NESTING:
            raise ProtocolError(_TOO_DEEP, "json")
        kind = data.pop("type", None)
        build = self._builders.get(kind) if type(kind) is str else None
        if build is None:
            if kind is None:
                raise ProtocolError("the message has no type")
            raise ProtocolError(f"unknown message type {shown(kind)}")
        message: Message = build(data)
        return message

    def decode_as(self, payload: bytes, expected: type[M]) -> M:
        """Like :meth:`decode`, but anything other than ``expected`` is a ProtocolError."""
        message = self.decode(payload)
        if not isinstance(message, expected):
            raise ProtocolError(f"expected {expected.TYPE!r}, got {message.TYPE!r}")
        return message


_TOO_DEEP = f"frame is nested deeper than {MAX_NESTING} levels"


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A decoded JSON object; a key given twice is refused (which one would count?)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        raise ProtocolError("a JSON object repeats a key", "json")
    return data


def _nesting(value: Any) -> int:
    """How deeply objects and lists nest in ``value`` (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if type(node) is dict else node if type(node) is list else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest
