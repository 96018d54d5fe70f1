"""The broker's wire protocol: length-prefixed frames carrying typed JSON messages.

Spoken on the node agent's unix sockets: between a KV pool's broker client and the
broker (``broker.sock``), and between ``kvshare ctl``/``kvshare top`` and the agent
(``admin.sock``). Standard library only: the runtime imports this module inside engine
images.

Framing
-------
Every frame is a 4-byte big-endian payload length followed by the payload: one UTF-8
JSON object ``{"type": <name>, <field>: <value>, ...}``. A frame is at most
:data:`MAX_FRAME_BYTES` of payload (:data:`MAX_REQUEST_BYTES` towards the node agent).

Decoding is the one gate for what a peer sends: everything is checked here, before any
value reaches the broker's books, its logs, its metrics or a terminal. An unknown type, a
missing, unknown or repeated field, a value of the wrong type, nesting deeper than
:data:`MAX_NESTING`, an integer outside 64 bits, a number that is not finite, or a string
outside its field's :class:`Syntax` is a :class:`ProtocolError`; the peer that receives
one closes that connection and nothing else. Identities (GPU, namespace, pod, pod UID,
ModelServer, engine) must have the syntax Kubernetes or NVML gives them; every other
string is :data:`TEXT`: printable, without control characters, bounded in length.

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
import math
import re
import struct
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

__all__ = [
    "BROKER_CODEC",
    "MAX_FRAME_BYTES",
    "MAX_NESTING",
    "MAX_REQUEST_BYTES",
    "PROTOCOL_VERSION",
    "TEXT",
    "Bye",
    "Codec",
    "FrameReader",
    "GpuId",
    "GroupName",
    "Hello",
    "LabelValue",
    "LayoutReasonName",
    "Lease",
    "Message",
    "Namespace",
    "ObjectName",
    "PageLayoutName",
    "ProtocolError",
    "Reclaim",
    "Refused",
    "Report",
    "Syntax",
    "TurnDone",
    "TurnGranted",
    "TurnRefused",
    "TurnRequest",
    "Uid",
    "Want",
    "Welcome",
    "encode_frame",
]

#: Version a client states in :class:`Hello`; the broker refuses versions it does not speak.
PROTOCOL_VERSION = 1
#: Largest payload of one frame. Every real message is far smaller (admin replies, which
#: list every pool, have a limit of their own).
MAX_FRAME_BYTES = 256 * 1024
#: Largest payload of a frame sent *to* the node agent (pools, start-up turns, admin
#: requests): the largest real one, a hello with every name at its longest, is < 2 KiB.
MAX_REQUEST_BYTES = 16 * 1024
#: Deepest nesting of JSON objects and lists a message may have (an admin reply has 4).
MAX_NESTING = 8

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
_INT64 = range(-(2**63), 2**63)

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


@dataclass(frozen=True, slots=True)
class Syntax:
    """What one string field may hold; checked on every message decoded.

    ``pattern`` (ASCII only, matched whole) is the syntax the value gets where it is
    made: Kubernetes for namespaces, pods and objects, NVML for GPU UUIDs. Without one,
    any printable text is allowed: no control, format or surrogate characters.
    ``optional`` allows the empty string (a name the pool does not know).
    """

    what: str
    max_length: int
    pattern: re.Pattern[str] | None = None
    optional: bool = False
    kind: ErrorKind = "identity"

    def problem(self, value: str) -> str | None:
        """Why ``value`` does not have this syntax, or ``None``."""
        if not value and self.optional:
            return None
        if len(value) > self.max_length:
            return f"{len(value)} characters, more than the {self.max_length} of {self.what}"
        if self.pattern is None:
            return None if value.isprintable() else f"{_shown(value)} is not printable text"
        return None if self.pattern.fullmatch(value) else f"{_shown(value)} is not {self.what}"


def _syntax(regex: str) -> re.Pattern[str]:
    return re.compile(regex, re.ASCII)


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"

#: Free text (reasons, errors, names the agent makes): printable, at most 4096 characters.
TEXT = Syntax("text", 4096, kind="message")
#: A GPU as NVML names it (``GPU-<uuid>``, ``MIG-<uuid>``, ``MIG-GPU-<uuid>/1/0``).
GpuId = Annotated[
    str,
    Syntax(
        "a GPU UUID (letters, digits and '-', '_', '.', ':', '/', at most 128)",
        128,
        _syntax(r"[A-Za-z0-9][-A-Za-z0-9_.:/]*"),
    ),
]
#: A Kubernetes namespace: a DNS label.
Namespace = Annotated[
    str,
    Syntax(
        "a Kubernetes namespace (a DNS label: lowercase letters, digits and '-', at most 63)",
        63,
        _syntax(_DNS_LABEL),
        optional=True,
    ),
]
#: A Kubernetes object name (pods, ModelServers): a DNS subdomain.
ObjectName = Annotated[
    str,
    Syntax(
        "a Kubernetes object name (a DNS subdomain: lowercase letters, digits, '-' and "
        "'.', at most 253)",
        253,
        _syntax(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"),
        optional=True,
    ),
]
#: A Kubernetes object UID.
Uid = Annotated[
    str,
    Syntax(
        "a Kubernetes UID (a UUID such as 0f8fad5b-d9cb-469f-a165-70867728950e)",
        36,
        _syntax(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        optional=True,
    ),
]
#: A tensor-parallel group's name, as the runtime makes it (``<pod uid>/<engine group>``).
GroupName = Annotated[
    str,
    Syntax(
        "a start-up group name (letters, digits and '-', '_', '.', '/', at most 128)",
        128,
        _syntax(r"[A-Za-z0-9][-A-Za-z0-9_./]*"),
        optional=True,
    ),
]
#: How a pool's pages hold the engine's blocks (``kvshare.runtime.paging``), or ``""``.
PageLayoutName = Annotated[
    str,
    Syntax(
        "a page layout (block-outer or per-layer)",
        16,
        _syntax(r"block-outer|per-layer"),
        optional=True,
        kind="message",
    ),
]
#: Why a pool keeps per-layer pages (``kvshare.runtime.paging.LAYOUT_REASONS``), or ``""``.
LayoutReasonName = Annotated[
    str,
    Syntax(
        "a page layout reason (setting, engine-setting, backend, model, connector, engine)",
        16,
        _syntax(r"setting|engine-setting|backend|model|connector|engine"),
        optional=True,
        kind="message",
    ),
]
#: A Kubernetes label value.
LabelValue = Annotated[
    str,
    Syntax(
        "a Kubernetes label value (letters, digits, '-', '_' and '.', at most 63)",
        63,
        _syntax(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"),
        optional=True,
    ),
]


def _shown(value: object) -> str:
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
    gpu: GpuId
    page_size: int
    kv_min: int
    kv_max: int | None
    priority: int
    static: int
    namespace: Namespace = ""
    pod: ObjectName = ""
    pod_uid: Uid = ""
    modelserver: ObjectName = ""
    rank: int = 0
    tp_size: int = 1
    engine: LabelValue = ""
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
    on what the pool already gave back. ``page_bytes`` is the physical memory the pool
    maps and unmaps at a time (one logical page), ``layout`` what a page holds
    (``block-outer``: whole blocks of all layers; ``per-layer``: a granule of every
    layer) and ``layout_reason`` why a pool keeps per-layer pages (0 and ``""``: not
    stated).
    """

    TYPE: ClassVar[str] = "report"
    mapped: int
    used: int
    cached: int
    reserved: int
    ack: int = 0
    page_bytes: int = 0
    layout: PageLayoutName = ""
    layout_reason: LayoutReasonName = ""

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
    gpu: GpuId
    static: int = 0
    kv_min: int = 0
    pod_uid: Uid = ""
    rank: int = 0
    group: GroupName = ""
    group_size: int = 1


@dataclass(frozen=True, slots=True)
class TurnGranted(Message):
    """The start-up turn is this connection's until :class:`TurnDone` or close.

    ``gpu_total`` is the GPU's memory as the node agent's inventory has it (NVML, or the
    declared ``--fake-gpus``): what an engine without a device of its own to ask (the
    ``host`` backend) sizes its KV cache from. 0 from a broker that does not say.
    """

    TYPE: ClassVar[str] = "turn-granted"
    seq: int
    hold_s: float
    gpu_total: int = 0


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
                raise ProtocolError(f"{where}: expected {expected}, got {_shown(value)}")
            if type(value) is int and value not in _INT64:
                raise ProtocolError(f"{where}: {_shown(value)} does not fit in 64 bits")
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
                raise ProtocolError(f"{where}: expected an object, got {_shown(value)}")
            return build(value)

        return check_nested
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def _string_checker(syntax: Syntax, where: str) -> typing.Callable[[Any], Any]:
    def check_string(value: Any) -> Any:
        if type(value) is not str:
            raise ProtocolError(f"{where}: expected a string, got {_shown(value)}")
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
            shown = ", ".join(_shown(name) for name in sorted(unknown)[:8])
            raise ProtocolError(f"{cls.__name__}: unknown fields [{shown}]")
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
            raise ProtocolError(f"unknown message type {_shown(kind)}")
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


def encode_frame(payload: bytes, limit: int = MAX_FRAME_BYTES) -> bytes:
    """``payload`` behind its length header; refuses payloads over ``limit``."""
    if len(payload) > limit:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {limit}", "frame")
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
                    raise ProtocolError(f"frame length {length} outside 1..{self._limit}", "frame")
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
