"""The broker's wire protocol: length-prefixed frames carrying typed JSON messages.

Spoken on the node agent's unix sockets: between a KV pool's broker client and the
broker (``broker.sock``), and between ``kvshare ctl``/``kvshare top`` and the agent
(``admin.sock``). Standard library only: the runtime imports this module inside engine
images.

Framing
-------
Every frame is a 4-byte big-endian payload length followed by the payload: one UTF-8
JSON object ``{"type": <name>, <field>: <value>, ...}``. A frame is at most
:data:`MAX_FRAME_BYTES` of payload. Decoding is strict: an unknown type, a missing or
unknown field, or a value of the wrong type is a :class:`ProtocolError`; the peer that
receives one closes that connection and nothing else.

Conversation with the broker
----------------------------
A pool connection starts with :class:`Hello` and is answered with :class:`Welcome` or
:class:`Refused`. After that every message acts on *this connection's* pool only (no
message names another pool):

- :class:`Want` (``seq`` > 0) asks for the lease to reach ``total`` bytes; it is always
  answered by exactly one :class:`Lease` echoing ``seq``. More may be granted later by an
  unsolicited :class:`Lease` (``seq`` 0) once reclaimed memory has been released.
- :class:`Reclaim` lowers the lease; the pool shrinks and acknowledges with a
  :class:`Report` whose ``ack`` is the reclaim's ``seq`` and whose held bytes are within
  the new lease. Until then the broker keeps counting the old lease as taken.
- :class:`Report` tells the broker what the pool holds (on change and on a timer).
- :class:`Bye` ends the conversation after the pool has released its memory.

A start-up turn connection starts with :class:`TurnRequest`, is answered by
:class:`TurnGranted` (possibly after a wait) or :class:`TurnRefused`, and ends with
:class:`TurnDone` or by closing.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

__all__ = [
    "BROKER_CODEC",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Bye",
    "Codec",
    "FrameReader",
    "Hello",
    "Lease",
    "Message",
    "ProtocolError",
    "Reclaim",
    "Refused",
    "Report",
    "TurnDone",
    "TurnGranted",
    "TurnRefused",
    "TurnRequest",
    "Want",
    "Welcome",
    "encode_frame",
]

#: Version a client states in :class:`Hello`; the broker refuses versions it does not speak.
PROTOCOL_VERSION = 1
#: Largest payload of one frame. Every real message is far smaller; admin listings of a
#: few hundred pools stay well under it.
MAX_FRAME_BYTES = 256 * 1024

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol; the connection carrying it is closed."""


class Message:
    """Base of every wire message: a frozen dataclass with a unique ``TYPE`` name."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""


M = TypeVar("M", bound=Message)


# --- pool -> broker ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A pool introduces itself: who it is, where it runs, and its lease policy.

    ``resume`` is set when a pool that already holds memory reconnects (after a broker
    restart or a lost connection); ``held``, ``used`` and ``lease`` then re-declare what
    it holds, how much of that holds blocks in use, and the lease it had, and the broker
    rebuilds its books from them.
    """

    TYPE: ClassVar[str] = "hello"
    version: int
    gpu: str
    page_size: int
    kv_min: int
    kv_max: int | None
    priority: int
    static: int
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    modelserver: str = ""
    rank: int = 0
    tp_size: int = 1
    engine: str = ""
    resume: bool = False
    held: int = 0
    used: int = 0
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Want(Message):
    """Ask for the lease to reach ``total`` bytes (a total, not an increment)."""

    TYPE: ClassVar[str] = "want"
    seq: int
    total: int


@dataclass(frozen=True, slots=True)
class Report(Message):
    """What the pool holds now.

    ``ack`` > 0 says the numbers were taken with the reclaim ``seq`` in force (its lower
    limit already applied, so the pool no longer grows beyond what it reports): the
    broker completes that reclaim once ``held`` fits its limit, and before that may hand
    on what the pool already gave back.
    """

    TYPE: ClassVar[str] = "report"
    mapped: int
    used: int
    cached: int
    reserved: int
    ack: int = 0

    @property
    def held(self) -> int:
        """Physical bytes held: mapped plus reserved pages."""
        return self.mapped + self.reserved


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """The pool has released its memory and is leaving."""

    TYPE: ClassVar[str] = "bye"


# --- broker -> pool ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """The pool is admitted: its id and name in the broker's books and its lease."""

    TYPE: ClassVar[str] = "welcome"
    pool_id: int
    name: str
    lease: int
    kv_max: int | None


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """The pool is not admitted (or the connection is being closed), and why."""

    TYPE: ClassVar[str] = "refused"
    reason: str


@dataclass(frozen=True, slots=True)
class Lease(Message):
    """The pool's lease is now ``limit`` bytes. ``seq`` echoes a :class:`Want` (0: unasked)."""

    TYPE: ClassVar[str] = "lease"
    seq: int
    limit: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reclaim(Message):
    """Lower the lease to ``limit`` and acknowledge within ``deadline_s`` seconds."""

    TYPE: ClassVar[str] = "reclaim"
    seq: int
    limit: int
    deadline_s: float
    reason: str = ""


# --- start-up turns ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnRequest(Message):
    """Ask for the GPU's start-up turn, with room for ``static`` + ``kv_min`` bytes.

    The ranks of a tensor-parallel group (``group``, ``group_size`` > 1, each with its own
    ``rank`` and GPU) get their turns together, once every rank has asked.
    """

    TYPE: ClassVar[str] = "turn-request"
    seq: int
    gpu: str
    static: int = 0
    kv_min: int = 0
    pod_uid: str = ""
    rank: int = 0
    group: str = ""
    group_size: int = 1


@dataclass(frozen=True, slots=True)
class TurnGranted(Message):
    """The start-up turn is this connection's until :class:`TurnDone` or close."""

    TYPE: ClassVar[str] = "turn-granted"
    seq: int
    hold_s: float


@dataclass(frozen=True, slots=True)
class TurnRefused(Message):
    """The start-up turn cannot be given, and why."""

    TYPE: ClassVar[str] = "turn-refused"
    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class TurnDone(Message):
    """The engine has finished starting; the next one may go."""

    TYPE: ClassVar[str] = "turn-done"
    seq: int


# --- encoding ---------------------------------------------------------------------------


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
    if hint in _PLAIN:
        accepted, expected = _PLAIN[hint]

        def check_plain(value: Any) -> Any:
            # Exact types: JSON true is not an integer, 1.0 is not a count of bytes.
            if type(value) not in accepted:
                raise ProtocolError(f"{where}: expected {expected}, got {value!r}")
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
                raise ProtocolError(f"{where}: expected an object, got {value!r}")
            return build(value)

        return check_nested
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def _builder(cls: type[Any]) -> typing.Callable[[dict[str, Any]], Any]:
    """A function that builds ``cls`` from a decoded JSON object, strictly."""
    hints = typing.get_type_hints(cls)
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
            raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
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

    def __init__(self, message_types: Iterable[type[Message]]) -> None:
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
        return encode_frame(json.dumps(body, separators=(",", ":")).encode())

    def decode(self, payload: bytes) -> Message:
        """The message in one frame's payload; :class:`ProtocolError` when it is not one."""
        try:
            data = json.loads(payload)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"frame is not a JSON object: {exc}") from None
        if type(data) is not dict:
            raise ProtocolError("frame is not a JSON object")
        kind = data.pop("type", None)
        build = self._builders.get(kind) if type(kind) is str else None
        if build is None:
            raise ProtocolError(f"unknown message type {kind!r}")
        message: Message = build(data)
        return message

    def decode_as(self, payload: bytes, expected: type[M]) -> M:
        """Like :meth:`decode`, but anything other than ``expected`` is a ProtocolError."""
        message = self.decode(payload)
        if not isinstance(message, expected):
            raise ProtocolError(f"expected {expected.TYPE!r}, got {message.TYPE!r}")
        return message


def encode_frame(payload: bytes) -> bytes:
    """``payload`` behind its length header; refuses payloads over the frame limit."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Splits a byte stream into frame payloads, enforcing the size limit.

    Feed it whatever ``recv`` returned; it returns every payload now complete and keeps
    the rest. An empty or oversized frame is a :class:`ProtocolError` as soon as its
    header arrives, before its payload is buffered.
    """

    __slots__ = ("_buffer", "_limit")

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; the payloads of the frames that are now complete, in order."""
        buffer = self._buffer
        buffer += data
        payloads = []
        offset = 0
        try:
            while len(buffer) - offset >= HEADER_BYTES:
                (length,) = _HEADER.unpack_from(buffer, offset)
                if length == 0 or length > self._limit:
                    raise ProtocolError(f"frame length {length} outside 1..{self._limit}")
                end = offset + HEADER_BYTES + length
                if len(buffer) < end:
                    break
                payloads.append(bytes(buffer[offset + HEADER_BYTES : end]))
                offset = end
        finally:
            del buffer[:offset]
        return payloads

    def pending(self) -> int:
        """Bytes received that do not yet form a complete frame."""
        return len(self._buffer)


#: The messages of the pool <-> broker conversation and of start-up turns.
BROKER_CODEC = Codec(
    (
        Hello,
        Want,
        Report,
        Bye,
        Welcome,
        Refused,
        Lease,
        Reclaim,
        TurnRequest,
        TurnGranted,
        TurnRefused,
        TurnDone,
    )
)
