"""Talking to the node agent's memory broker from an engine process: who a pool is, what
it asks for, and the broker's socket.

:class:`PoolIdentity` and :class:`PoolPolicy` are what a pool declares in its hello;
:func:`connect` and :func:`read_messages` are the blocking socket steps a hello and a
start-up turn take (the lease thread of :class:`~kvshare.runtime.broker_client.BrokerLease`
does its own non-blocking I/O). Wire messages are in :mod:`kvshare.api.wire`; nothing
here imports the node agent.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvshare.api import env
from kvshare.api.wire import BROKER_CODEC, FrameReader, Message

__all__ = [
    "AdmissionRefusedError",
    "BrokerError",
    "BrokerUnavailableError",
    "PoolIdentity",
    "PoolPolicy",
    "StartupTurnRefusedError",
    "StartupTurnTimeoutError",
    "broker_present",
    "broker_socket_path",
    "connect",
    "read_messages",
]


class BrokerError(RuntimeError):
    """Base of the broker client's errors."""


class BrokerUnavailableError(BrokerError):
    """No broker answers at the socket."""


class AdmissionRefusedError(BrokerError):
    """The broker refused this pool; the message carries its reason."""


class StartupTurnTimeoutError(BrokerError, TimeoutError):
    """The GPU's start-up turn did not come within the timeout."""


class StartupTurnRefusedError(BrokerError):
    """The broker refused the start-up turn (e.g. the engine cannot fit on the GPU)."""


@dataclass(frozen=True)
class PoolIdentity:
    """Who the pool belongs to (pod identity from the downward API, engine facts)."""

    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    modelserver: str = ""
    rank: int = 0
    tp_size: int = 1
    engine: str = ""

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        rank: int = 0,
        tp_size: int = 1,
        engine: str = "",
    ) -> PoolIdentity:
        """Pod identity from ``KVSHARE_POD_*``/``KVSHARE_MODELSERVER``; the rest from
        the engine, which knows its rank and tensor-parallel size."""
        return cls(
            namespace=env.POD_NAMESPACE.read(environ) or "",
            pod=env.POD_NAME.read(environ) or "",
            pod_uid=env.POD_UID.read(environ) or "",
            modelserver=env.MODELSERVER.read(environ) or "",
            rank=rank,
            tp_size=tp_size,
            engine=engine,
        )


@dataclass(frozen=True)
class PoolPolicy:
    """How much the pool is guaranteed, may take, and gives back first."""

    kv_min: int = 0
    kv_max: int | None = None
    priority: int = 100
    static: int = 0
    page_size: int = 2 * 2**20
    capacity: int | None = None
    """The most the pool can ever hold (its virtual size); the broker's cap (``kv_max``,
    which may be raised in place) is enforced by the broker. None: ``kv_max``."""

    @property
    def ceiling(self) -> int | None:
        """The most the pool ever asks for."""
        return self.capacity if self.capacity is not None else self.kv_max

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PoolPolicy:
        """``KVSHARE_KV_MIN``/``KV_MAX``/``KV_CAPACITY``/``KV_PRIORITY``/``STATIC_BYTES``/
        ``PAGE_SIZE``."""
        return cls(
            kv_min=env.KV_MIN.require(environ),
            kv_max=env.KV_MAX.read(environ),
            capacity=env.KV_CAPACITY.read(environ),
            priority=env.KV_PRIORITY.require(environ),
            static=env.STATIC_BYTES.require(environ),
            page_size=env.PAGE_SIZE.require(environ),
        )


def broker_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """The broker socket named by ``KVSHARE_BROKER_SOCKET`` (or its default)."""
    return env.BROKER_SOCKET.require(environ)


def connect(path: str, timeout: float) -> socket.socket:
    """A blocking connection to the broker at ``path``, or :class:`BrokerUnavailableError`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except FileNotFoundError:
        sock.close()
        raise BrokerUnavailableError(
            f"no broker socket at {path}: is the kvshare node agent running on this node "
            "(and /run/kvshare mounted)? For standalone use set KVSHARE_KV_LIMIT instead"
        ) from None
    except OSError as exc:
        sock.close()
        raise BrokerUnavailableError(f"cannot connect to the broker at {path}: {exc}") from None
    return sock


def read_messages(sock: socket.socket, reader: FrameReader, deadline: float) -> list[Message]:
    """Block until at least one whole message arrives (or the deadline passes); returns
    every message that arrived with it, in order."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer from the broker in time")
        sock.settimeout(remaining)
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the broker closed the connection")
        payloads = reader.feed(data)
        if payloads:
            return [BROKER_CODEC.decode(p) for p in payloads]


def broker_present(path: str) -> bool:
    """Whether ``path`` is a unix socket (a node agent's broker may answer there)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
