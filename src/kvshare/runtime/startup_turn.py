"""The GPU's start-up turn, taken from the node agent's broker by an engine that starts.

Engines starting on one GPU together would measure each other's memory; the broker lets
one engine (or one tensor-parallel group) at a time load, profile and allocate.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from kvshare.api import env
from kvshare.api.wire import (
    BROKER_CODEC,
    FrameReader,
    ProtocolError,
    Refused,
    TurnDone,
    TurnGranted,
    TurnRefused,
    TurnRequest,
)
from kvshare.runtime.broker_link import (
    BrokerUnavailableError,
    PoolIdentity,
    StartupTurnRefusedError,
    StartupTurnTimeoutError,
    broker_socket_path,
    connect,
    read_messages,
)

__all__ = ["startup_turn"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def startup_turn(
    gpu: str,
    *,
    static_bytes: int = 0,
    kv_min: int = 0,
    timeout_s: float | None = None,
    socket_path: str | None = None,
    identity: PoolIdentity | None = None,
    group: str = "",
) -> Iterator[TurnGranted]:
    """Hold the GPU's start-up turn while an engine loads and profiles memory.

    One engine per GPU at a time; the broker first makes room for ``static_bytes`` +
    ``kv_min`` (reclaiming lent memory). A rank of a tensor-parallel group (``identity``'s
    TP size > 1) names its ``group``: the broker gives the group's turns all at once, once
    every rank has asked, so ranks waiting for each other inside their turns never
    deadlock against another group. Yields the grant: the longest the turn may be held
    (the broker takes it back after that) and the GPU's memory. Raises
    :class:`StartupTurnTimeoutError` after ``timeout_s`` (default
    ``KVSHARE_STARTUP_TIMEOUT``), :class:`StartupTurnRefusedError` when the engine cannot
    fit, :class:`BrokerUnavailableError` without a broker.
    """
    wait = timeout_s if timeout_s is not None else env.STARTUP_TIMEOUT.require()
    path = socket_path or broker_socket_path()
    who = identity or PoolIdentity()
    sock = connect(path, min(wait, 5.0))
    try:
        request = TurnRequest(
            seq=1,
            gpu=gpu,
            static=static_bytes,
            kv_min=kv_min,
            pod_uid=who.pod_uid,
            rank=who.rank,
            group=group if who.tp_size > 1 else "",
            group_size=who.tp_size if group else 1,
        )
        sock.sendall(BROKER_CODEC.encode(request))
        try:
            answer = read_messages(sock, FrameReader(), time.monotonic() + wait)[0]
        except TimeoutError:
            raise StartupTurnTimeoutError(
                f"no start-up turn on GPU {gpu} within {wait:g} s (another engine is still "
                "starting there; raise KVSHARE_STARTUP_TIMEOUT to wait longer)"
            ) from None
        except (OSError, ProtocolError) as exc:
            raise BrokerUnavailableError(
                f"lost the broker while waiting for a turn: {exc}"
            ) from None
        if isinstance(answer, TurnRefused | Refused):
            raise StartupTurnRefusedError(f"start-up turn on GPU {gpu} refused: {answer.reason}")
        if not isinstance(answer, TurnGranted):
            raise BrokerUnavailableError(f"unexpected {answer.TYPE!r} from the broker")
        log.info("holding the start-up turn of GPU %s", gpu)
        yield answer
        with contextlib.suppress(OSError):
            sock.sendall(BROKER_CODEC.encode(TurnDone(seq=request.seq)))
    finally:
        sock.close()
