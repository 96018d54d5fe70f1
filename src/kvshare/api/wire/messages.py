"""The messages of the broker's conversations: a pool's (:class:`Hello`, :class:`Want`,
:class:`Report`, :class:`Bye` from the pool; :class:`Welcome`, :class:`Refused`,
:class:`Lease`, :class:`Reclaim` from the broker) and a start-up turn's
(:class:`TurnRequest`, :class:`TurnGranted`, :class:`TurnRefused`, :class:`TurnDone`),
and :data:`BROKER_CODEC`, which speaks them all. The conversations are described in
:mod:`kvshare.api.wire`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvshare.api.wire.codec import Codec, Message
from kvshare.api.wire.syntax import (
    GpuId,
    GroupName,
    LabelValue,
    LayoutReasonName,
    Namespace,
    ObjectName,
    PageLayoutName,
    Uid,
)

__all__ = [
    "BROKER_CODEC",
    "PROTOCOL_VERSION",
    "Bye",
    "Hello",
    "Lease",
    "Reclaim",
    "Refused",
    "Report",
    "TurnDone",
    "TurnGranted",
    "TurnRefused",
    "TurnRequest",
    "Want",
    "Welcome",
]

#: Version a client states in :class:`Hello`; the broker refuses versions it does not speak.
PROTOCOL_VERSION = 1


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
