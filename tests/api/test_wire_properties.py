"""Properties of the wire codec over generated input: whatever a peer sends, decoding
returns a message whose every value is within its field's rules, or a ProtocolError —
never another exception, never a value outside the rules."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Annotated, Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.api import wire
from kvshare.api.wire import (
    BROKER_CODEC,
    MAX_NESTING,
    TEXT,
    FrameReader,
    Message,
    ProtocolError,
    Syntax,
    encode_frame,
)
from kvshare.deviceplugin.broker.connections.admin_requests import (
    ADMIN_CODEC,
    AdminReply,
    AdminRequest,
)

BROKER_MESSAGES: list[type[Message]] = [wire.Hello, wire.Want, wire.Report, wire.Bye,
    wire.Welcome, wire.Refused, wire.Lease, wire.Reclaim, wire.TurnRequest, wire.TurnGranted,
    wire.TurnRefused, wire.TurnDone]  # fmt: skip
MESSAGE_TYPES = [*BROKER_MESSAGES, AdminRequest, AdminReply]
CODECS = {cls: ADMIN_CODEC if cls in (AdminRequest, AdminReply) else BROKER_CODEC
          for cls in MESSAGE_TYPES}  # fmt: skip
PROPERTIES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any string at all: lone surrogates, controls, escapes, look-alikes, long ones.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=80) | st.sampled_from(
    ["\ud800", "a\nb", "\x1b[2J", "\u202e", "\uff51wen", "x" * 300, "", "GPU-0", "llm"]
)
ANY_INT = st.integers() | st.sampled_from([2**63, -(2**63) - 1, 10**400, 2**64])
ANY_FLOAT = st.floats() | st.sampled_from([math.inf, -math.inf, math.nan, 1e308])


def any_json(depth: int = 3) -> st.SearchStrategy[Any]:
    """Any JSON value, including what Python's json writes beyond JSON (NaN, Infinity)."""
    scalars = st.none() | st.booleans() | ANY_INT | ANY_FLOAT | ANY_TEXT
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
        max_leaves=12,
    )


def syntax_of(hint: Any) -> Syntax | None:
    if typing.get_origin(hint) is Annotated:
        return next(e for e in typing.get_args(hint)[1:] if isinstance(e, Syntax))
    return TEXT if hint is str else None


def valid_value(hint: Any) -> st.SearchStrategy[Any]:
    """Values a field of type ``hint`` accepts."""
    syntax = syntax_of(hint)
    if syntax is not None:
        if syntax.pattern is None:
            return st.text(st.characters(categories=("L", "N", "P", "S")), max_size=40)
        names = st.from_regex(syntax.pattern, fullmatch=True).filter(
            lambda s: len(s) <= syntax.max_length
        )
        return names | st.just("") if syntax.optional else names
    origin = typing.get_origin(hint)
    if hint is int:
        return st.integers(-(2**63), 2**63 - 1)
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if hint is bool:
        return st.booleans()
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return st.none() | valid_value(inner)
    if origin is list:
        return st.lists(valid_value(typing.get_args(hint)[0]), max_size=3)
    assert dataclasses.is_dataclass(hint), hint
    return valid_message(hint)


def valid_message(cls: Any) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: valid_value(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


def assert_within_rules(value: Any, hint: Any) -> None:
    """Every value of a decoded message obeys its field's rules."""
    syntax = syntax_of(hint)
    if syntax is not None:
        assert type(value) is str and syntax.problem(value) is None
        assert value.isprintable() or value == ""
        return
    if hint is int:
        assert type(value) is int and -(2**63) <= value < 2**63
    elif hint is float:
        assert type(value) is float and math.isfinite(value)
    elif hint is bool:
        assert type(value) is bool
    elif typing.get_origin(hint) is list:
        for item in value:
            assert_within_rules(item, typing.get_args(hint)[0])
    elif typing.get_args(hint) and type(None) in typing.get_args(hint):
        if value is not None:
            (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
            assert_within_rules(value, inner)
    else:
        hints = typing.get_type_hints(type(value), include_extras=True)
        for f in dataclasses.fields(value):
            assert_within_rules(getattr(value, f.name), hints[f.name])


def decode_checked(codec: Any, payload: bytes) -> Message | None:
    """Decode; a message must obey every rule and survive a round trip."""
    try:
        message: Message = codec.decode(payload)
    except ProtocolError:
        return None
    assert_within_rules(message, type(message))
    assert codec.decode(codec.encode(message)[4:]) == message
    return message


@PROPERTIES
@given(st.binary(max_size=512))
def test_any_bytes_decode_to_a_message_or_a_protocol_error(payload: bytes) -> None:
    for codec in (BROKER_CODEC, ADMIN_CODEC):
        decode_checked(codec, payload)


@PROPERTIES
@given(st.sampled_from(MESSAGE_TYPES), st.data())
def test_any_json_shaped_like_a_message_is_within_the_rules_or_refused(
    cls: type[Message], data: st.DataObject
) -> None:
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    keys = st.sampled_from(names) | ANY_TEXT if names else ANY_TEXT
    body = data.draw(st.dictionaries(keys, any_json(), max_size=len(names) + 1))
    payload = json.dumps({"type": cls.TYPE, **body}).encode()
    decode_checked(CODECS[cls], payload)


@PROPERTIES
@given(st.sampled_from(MESSAGE_TYPES), st.data())
def test_one_hostile_value_in_a_valid_message_is_taken_only_within_the_rules(
    cls: type[Message], data: st.DataObject
) -> None:
    message = data.draw(valid_message(cls))
    body = json.loads(CODECS[cls].encode(message)[4:])
    field = data.draw(st.sampled_from(sorted(body)))
    body[field] = data.draw(any_json())
    decode_checked(CODECS[cls], json.dumps(body).encode())


@PROPERTIES
@given(st.sampled_from(MESSAGE_TYPES), st.data())
def test_every_valid_message_survives_a_round_trip(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(valid_message(cls))
    assert decode_checked(CODECS[cls], CODECS[cls].encode(message)[4:]) == message


@PROPERTIES
@given(st.integers(1, 200))
def test_nesting_beyond_the_limit_is_refused_and_within_it_is_only_a_type_question(
    depth: int,
) -> None:
    value = "[" * depth + "]" * depth
    payload = f'{{"type": "want", "seq": 1, "total": {value}}}'.encode()
    try:
        BROKER_CODEC.decode(payload)
    except ProtocolError as error:
        deep = depth + 1 > MAX_NESTING
        assert ("nested deeper" in str(error)) == deep
        assert error.kind == ("json" if deep else "message")


@PROPERTIES
@given(st.lists(st.binary(min_size=1, max_size=300), max_size=8), st.data())
def test_frames_come_out_whole_whatever_the_receive_boundaries(
    payloads: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    reader = FrameReader()
    out: list[bytes] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += reader.feed(stream[start:end])
    assert out == payloads and reader.pending() == 0
