"""The broker's wire protocol: length-prefixed frames carrying typed JSON messages.

Spoken on the node agent's unix sockets: between a KV pool's broker client and the
broker (``broker.sock``), and between ``kvshare ctl``/``kvshare top`` and the agent
(``admin.sock``). Standard library only: the runtime imports this package inside engine
images.

Its parts: :mod:`.framing` (frames and their size limits), :mod:`.codec` (messages in
and out of JSON, strictly checked), :mod:`.syntax` (what each string may hold),
:mod:`.errors` (:class:`ProtocolError`) and :mod:`.messages` (the broker's messages and
their codec). Import the names from here.

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

from kvshare.api.wire.codec import MAX_NESTING, Codec, Message
from kvshare.api.wire.errors import ProtocolError
from kvshare.api.wire.framing import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    FrameReader,
    encode_frame,
)
from kvshare.api.wire.messages import (
    BROKER_CODEC,
    PROTOCOL_VERSION,
    Bye,
    Hello,
    Lease,
    Reclaim,
    Refused,
    Report,
    TurnDone,
    TurnGranted,
    TurnRefused,
    TurnRequest,
    Want,
    Welcome,
)
from kvshare.api.wire.syntax import (
    TEXT,
    GpuId,
    GroupName,
    LabelValue,
    LayoutReasonName,
    Namespace,
    ObjectName,
    PageLayoutName,
    Syntax,
    Uid,
)

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
