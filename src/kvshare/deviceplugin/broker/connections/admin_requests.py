"""The admin socket's requests: what ``kvshare ctl`` and ``kvshare top`` ask the node agent.

Same framing as the broker (:mod:`kvshare.api.wire`), its own messages: one
:class:`AdminRequest`, one :class:`AdminReply`. Requests are executed by the broker's
own thread against its books (:func:`execute`), so an admin change and pool traffic
never race. The client side is :mod:`kvshare.deviceplugin.admin.client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvshare.api.wire import Codec, Message, ProtocolError
from kvshare.deviceplugin.broker import peers
from kvshare.deviceplugin.broker.books import Books, Send
from kvshare.deviceplugin.broker.connections import auth
from kvshare.deviceplugin.broker.views import BooksView

__all__ = ["ADMIN_CODEC", "OPS", "AdminReply", "AdminRequest", "answer", "execute"]

Op = Literal["list", "set-max", "drain", "undrain"]
OPS: tuple[str, ...] = ("list", "set-max", "drain", "undrain")


@dataclass(frozen=True, slots=True)
class AdminRequest(Message):
    """``list``; ``set-max`` (``pool``, ``size`` or None for no cap); ``drain``/``undrain``
    (``gpu`` by UUID or index)."""

    TYPE: ClassVar[str] = "admin-request"
    op: str
    pool: str = ""
    gpu: str = ""
    size: int | None = None


@dataclass(frozen=True, slots=True)
class AdminReply(Message):
    """The books after the request, or why it failed."""

    TYPE: ClassVar[str] = "admin-reply"
    ok: bool
    error: str = ""
    view: BooksView | None = None


#: Largest admin reply: the books of ~20,000 pools (one process may hold at most 64;
#: real nodes hold tens).
MAX_REPLY_BYTES = 8 * 2**20

ADMIN_CODEC = Codec((AdminRequest, AdminReply), max_frame_bytes=MAX_REPLY_BYTES)


def answer(
    books: Books, message: Message, peer: peers.Peer, now: float
) -> tuple[AdminReply, list[Send], str | None]:
    """The reply to ``message`` from ``peer`` (under the broker's lock), the messages it
    makes pools get, and why the peer may not ask, if it may not (:mod:`.auth`)."""
    if not isinstance(message, AdminRequest):
        raise ProtocolError(f"{message.TYPE!r} is not an admin request")
    problem = auth.admin_problem(peer)
    if problem is not None:
        return AdminReply(ok=False, error=problem), [], problem
    reply, sends = execute(books, message, now)
    return reply, sends, None


def execute(books: Books, request: AdminRequest, now: float) -> tuple[AdminReply, list[Send]]:
    """Run ``request`` against ``books``: the reply and the messages it makes pools get."""
    sends: list[Send] = []
    try:
        if request.op == "set-max":
            matches = books.find(request.pool)
            if not matches:
                raise KeyError(f"no pool {request.pool!r} (see `kvshare ctl pools`)")
            if len(matches) > 1:
                ids = ", ".join(str(p.id) for p in matches)
                raise KeyError(f"{request.pool!r} names several pools; use an id ({ids})")
            sends = books.set_max(matches[0].id, request.size, now)
        elif request.op in ("drain", "undrain"):
            sends = books.set_draining(request.gpu, request.op == "drain", now)
        elif request.op != "list":
            raise KeyError(f"unknown admin operation {request.op!r}; one of {', '.join(OPS)}")
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        return AdminReply(ok=False, error=str(message)), sends
    return AdminReply(ok=True, view=books.view(now)), sends
