"""What a pool may say on its own connection, applied to the books: an ask (:class:`Want`),
what it holds (:class:`Report`) and its goodbye (:class:`Bye`). Anything else, or values
the books cannot take, is a protocol error that closes that connection only."""

from __future__ import annotations

from kvshare.api.wire import Bye, Message, ProtocolError, Report, Want
from kvshare.deviceplugin.broker.books import Books, Send

__all__ = ["apply"]


def apply(books: Books, pool_id: int, message: Message, now: float) -> list[Send]:
    """Apply ``message`` from pool ``pool_id`` to ``books`` (under the caller's lock):
    the messages it makes the broker send. After a :class:`Bye` the pool is gone."""
    if isinstance(message, Want):
        if message.seq <= 0:
            raise ProtocolError("want: seq must be > 0")
        return books.want(pool_id, message.seq, message.total, now)
    if isinstance(message, Report):
        sizes = (message.mapped, message.used, message.cached, message.reserved)
        if min(*sizes, message.page_bytes) < 0:
            raise ProtocolError("report: sizes must be >= 0")
        return books.report(pool_id, message, now)
    if isinstance(message, Bye):
        return books.remove(pool_id, "bye", now)
    raise ProtocolError(f"{message.TYPE!r} is not allowed on a pool connection")
