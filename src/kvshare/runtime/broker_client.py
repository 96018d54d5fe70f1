"""The node agent's memory broker, seen from a KV pool: :class:`BrokerLease`, and the
names of :mod:`.broker_link` and :mod:`.startup_turn` that every user of the broker needs
(identity, policy, errors, the start-up turn).

:class:`BrokerLease` is the :class:`~kvshare.runtime.lease.LeaseSource` of a pool that
runs under the node agent. The pool's hot path only reads :meth:`BrokerLease.limit` and
posts wishes (:meth:`~BrokerLease.want`, :meth:`~BrokerLease.report`); one background
thread (``kvshare-lease``) talks to the broker:

- what it asks and when it reports follow :mod:`kvshare.runtime.lease_conversation`
  (chunks, slow start, reclaim acknowledgements), its asks capped at its capacity; the
  broker caps them at the ``kv_max`` in force (which may be raised in place: the broker
  remembers what was asked beyond the old one) and grants at most what is free plus what
  its policy allows, and lease it then leaves unused is *idle*, which the broker takes
  back at once when another pool waits;
- grants and reclaims arrive as :meth:`LeaseHolder.lease_changed` calls on that thread.
  A pool must report after ``lease_changed`` even when it had nothing to release (the
  runtime's pool does, and reports on a timer too): the report acknowledges a reclaim;
- when the connection drops (a broker restart), the pool keeps its memory and lease, and
  the thread reconnects with exponential backoff and re-declares what it holds.

Wire messages are in :mod:`kvshare.api.wire`; nothing here imports the node agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import selectors
import socket
import threading
import time

from kvshare.api.wire import (
    BROKER_CODEC,
    PROTOCOL_VERSION,
    Bye,
    FrameReader,
    Hello,
    Lease,
    Message,
    ProtocolError,
    Reclaim,
    Refused,
    Welcome,
)
from kvshare.runtime.broker_link import (
    AdmissionRefusedError,
    BrokerError,
    BrokerUnavailableError,
    PoolIdentity,
    PoolPolicy,
    StartupTurnRefusedError,
    StartupTurnTimeoutError,
    broker_present,
    broker_socket_path,
    connect,
    read_messages,
)
from kvshare.runtime.lease import LeaseHolder, LeaseSource, PoolUsage
from kvshare.runtime.lease_conversation import IDLE_S, LeaseConversation
from kvshare.runtime.startup_turn import startup_turn

__all__ = [
    "DEFAULT_SLOW_START_WINDOW_S",
    "AdmissionRefusedError",
    "BrokerError",
    "BrokerLease",
    "BrokerUnavailableError",
    "PoolIdentity",
    "PoolPolicy",
    "StartupTurnRefusedError",
    "StartupTurnTimeoutError",
    "broker_present",
    "broker_socket_path",
    "startup_turn",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_PAGES = 16
#: A pool that wants more this soon after being granted all it asked for is still growing.
DEFAULT_SLOW_START_WINDOW_S = 1.0


class BrokerLease(LeaseSource):
    """A lease brokered by the node agent (see the module docstring).

    Thread-safety: :meth:`limit`, :meth:`want` and :meth:`report` may be called from any
    thread and never block on I/O (a wish is written to the socket at once when that
    does not block, else by the lease thread); the holder is called back on the
    ``kvshare-lease`` thread.
    """

    def __init__(
        self,
        gpu: str,
        *,
        policy: PoolPolicy,
        identity: PoolIdentity | None = None,
        socket_path: str | None = None,
        chunk_bytes: int | None = None,
        connect_timeout_s: float = 5.0,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 2.0,
        report_interval_s: float = 0.05,
        slow_start_window_s: float = DEFAULT_SLOW_START_WINDOW_S,
    ) -> None:
        if policy.page_size <= 0:
            raise ValueError(f"page size must be > 0, not {policy.page_size}")
        self.gpu = gpu
        self.policy = policy
        self.identity = identity or PoolIdentity()
        self.socket_path = socket_path or broker_socket_path()
        self._connect_timeout = connect_timeout_s
        self._reconnect = (reconnect_initial_s, reconnect_max_s)

        # _lock guards the conversation (the limit, the wish and its growth step, the
        # latest usage, the pending reclaim ack, what was sent), which the pool's threads
        # and the lease thread share.
        self._lock = threading.Lock()
        self._talk = LeaseConversation(
            chunk_bytes=chunk_bytes or DEFAULT_CHUNK_PAGES * policy.page_size,
            page_size=policy.page_size,
            ceiling=policy.ceiling,
            report_interval_s=report_interval_s,
            slow_start_window_s=slow_start_window_s,
        )
        self._closed = False
        self._wake_queued = False
        # _send_lock guards the socket's writing side: _sock and _outbox (bytes not yet
        # accepted by the socket). It may take _lock inside; _lock never takes it.
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._outbox = bytearray()

        # Owned by the lease thread once it runs (by attach() before that).
        self._holder: LeaseHolder | None = None
        self._reader = FrameReader()
        self._backlog: list[Message] = []
        self._pool_id = 0
        self._name = ""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_open = True
        self._thread: threading.Thread | None = None
        self._connected = threading.Event()

    # --- LeaseSource --------------------------------------------------------------------

    def attach(self, holder: LeaseHolder) -> None:
        """Connect, say hello and start the lease thread.

        Raises :class:`BrokerUnavailableError` when no broker answers and
        :class:`AdmissionRefusedError` (with the broker's reason) when the pool is refused.
        """
        if self._holder is not None:
            raise RuntimeError("BrokerLease.attach() was already called")
        self._holder = holder
        try:
            welcome = self._handshake(resume=False)
        except BaseException:
            self._close_pipe()
            raise
        with self._lock:
            self._talk.granted(welcome.lease, time.monotonic())
        self._thread = threading.Thread(target=self._run, name="kvshare-lease", daemon=True)
        self._thread.start()

    def limit(self) -> int:
        """The current lease in bytes (no I/O)."""
        return self._talk.limit

    def want(self, total_bytes: int) -> None:
        """Ask for the lease to reach ``total_bytes`` (in chunks, with slow start, capped at
        the pool's capacity, its ``kv_max`` when that is unknown: see
        :mod:`kvshare.runtime.lease_conversation`). Never blocks on I/O: the grant arrives
        via ``lease_changed``."""
        if self._closed:
            return
        with self._lock:
            grew = self._talk.want(total_bytes, time.monotonic())
        if grew:
            # The round trip starts here, not after a hop to the lease thread.
            self._send_want()

    def report(self, usage: PoolUsage) -> None:
        """Record what the pool holds; the lease thread sends it (coalesced)."""
        with self._lock:
            self._talk.report(usage)
        self._wake()

    def close(self) -> None:
        """Say goodbye (the pool has released its memory) and stop the lease thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._send_lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.settimeout(1.0)
                    sock.sendall(bytes(self._outbox) + BROKER_CODEC.encode(Bye()))
                sock.close()
        self._close_pipe()

    # --- extras -------------------------------------------------------------------------

    @property
    def pool_id(self) -> int:
        """The pool's id in the broker's books (changes when it re-declares)."""
        return self._pool_id

    @property
    def name(self) -> str:
        """The pool's name in the broker's books (``namespace/pod`` or ``pid-N``)."""
        return self._name

    def connected(self) -> bool:
        """Whether the lease thread is connected to a broker right now."""
        return self._connected.is_set()

    # --- the conversation ---------------------------------------------------------------

    def _hello(self, resume: bool) -> Hello:
        identity, policy = self.identity, self.policy
        usage = self._talk.usage
        return Hello(
            version=PROTOCOL_VERSION,
            gpu=self.gpu,
            page_size=policy.page_size,
            kv_min=policy.kv_min,
            kv_max=policy.kv_max,
            priority=policy.priority,
            static=policy.static,
            namespace=identity.namespace,
            pod=identity.pod,
            pod_uid=identity.pod_uid,
            modelserver=identity.modelserver,
            rank=identity.rank,
            tp_size=identity.tp_size,
            engine=identity.engine,
            resume=resume,
            held=usage.held if usage and resume else 0,
            used=usage.used if usage and resume else 0,
            lease=self._talk.limit if resume else 0,
        )

    def _handshake(self, resume: bool) -> Welcome:
        sock = connect(self.socket_path, self._connect_timeout)
        reader = FrameReader()
        try:
            sock.sendall(BROKER_CODEC.encode(self._hello(resume)))
            answer, *backlog = read_messages(sock, reader, time.monotonic() + self._connect_timeout)
        except (OSError, TimeoutError, ProtocolError) as exc:
            sock.close()
            raise BrokerUnavailableError(
                f"broker at {self.socket_path} did not welcome us: {exc}"
            ) from None
        if isinstance(answer, Refused):
            sock.close()
            raise AdmissionRefusedError(f"the kvshare broker refused this KV pool: {answer.reason}")
        if not isinstance(answer, Welcome):
            sock.close()
            raise BrokerUnavailableError(f"unexpected {answer.TYPE!r} from the broker")
        sock.setblocking(False)
        with self._send_lock:
            self._sock = sock
            self._outbox.clear()
            with self._lock:
                self._talk.connected()
        self._reader = reader
        self._backlog = backlog
        self._pool_id, self._name = answer.pool_id, answer.name
        self._connected.set()
        return answer

    def _send_want(self) -> None:
        """Send the wish if it grew past what was last asked (any thread)."""
        with self._send_lock:
            if self._sock is None:
                return
            with self._lock:
                want = self._talk.next_want()
            if want is not None:
                self._queue(BROKER_CODEC.encode(want))

    def _queue(self, data: bytes) -> None:
        """Write ``data`` now as far as the socket takes it without blocking; the lease
        thread writes the rest. ``_send_lock`` held."""
        sock = self._sock
        if sock is None:
            return
        if not self._outbox:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = 0  # the lease thread sees the broken connection when it reads
            data = data[sent:]
        if data:
            self._outbox += data
            self._wake()

    def _flush(self) -> None:
        """Write what the socket did not take yet (lease thread)."""
        with self._send_lock:
            sock = self._sock
            if sock is None or not self._outbox:
                return
            try:
                sent = sock.send(self._outbox)
            except BlockingIOError:
                return
            except OSError:
                return  # seen by the next read
            del self._outbox[:sent]

    def _wake(self) -> None:
        # One byte is enough to wake the thread: skip the syscall while one is queued.
        if self._wake_queued:
            return
        self._wake_queued = True
        if self._pipe_open:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _close_pipe(self) -> None:
        if self._pipe_open:
            self._pipe_open = False
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        watched: tuple[socket.socket, int] | None = None  # the socket in the selector, its mask

        def drop() -> None:
            nonlocal watched
            if watched is not None:
                selector.unregister(watched[0])
                watched = None
            self._disconnected()

        backoff = self._reconnect[0]
        next_connect = 0.0
        try:
            if not self._handle(self._take_backlog()):
                drop()
            while not self._closed:
                now = time.monotonic()
                if self._sock is None and now >= next_connect:
                    if self._try_reconnect() is not None:
                        backoff = self._reconnect[0]
                        if not self._handle(self._take_backlog()):
                            drop()
                    else:
                        next_connect = now + backoff * random.uniform(0.5, 1.0)
                        backoff = min(backoff * 2, self._reconnect[1])
                timeout = self._send_due(now)
                sock = self._sock
                if sock is None:
                    timeout = min(timeout, max(next_connect - now, 0.0))
                else:
                    mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._outbox else 0)
                    if watched is None:
                        selector.register(sock, mask, "sock")
                    elif watched != (sock, mask):
                        selector.modify(sock, mask, "sock")
                    watched = (sock, mask)
                for key, events in selector.select(timeout):
                    if key.data == "wake":
                        self._wake_queued = False
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush()
                    if events & selectors.EVENT_READ and not self._receive():
                        drop()
        except Exception:
            log.exception("kvshare lease thread failed; the lease stays at its last value")
        finally:
            selector.close()

    def _try_reconnect(self) -> socket.socket | None:
        try:
            welcome = self._handshake(resume=True)
        except AdmissionRefusedError as exc:
            log.error("%s; retrying", exc)
            return None
        except BrokerUnavailableError as exc:
            log.debug("reconnect failed: %s", exc)
            return None
        log.info(
            "reconnected to the broker as %s; re-declared lease %d", welcome.name, self._talk.limit
        )
        self._apply_limit(welcome.lease)
        return self._sock

    def _take_backlog(self) -> list[Message]:
        backlog, self._backlog = self._backlog, []
        return backlog

    def _disconnected(self) -> None:
        """Forget the connection (the lease thread has stopped watching its socket)."""
        with self._send_lock:
            sock, self._sock = self._sock, None
            self._outbox.clear()
        if sock is not None:
            sock.close()
        self._connected.clear()
        with self._lock:
            self._talk.disconnected()  # a new broker re-declares from what we hold now
        if not self._closed:
            log.warning("lost the broker; keeping lease %d and reconnecting", self._talk.limit)

    def _send_due(self, now: float) -> float:
        """Send the wish, a report or a reclaim acknowledgement if due; returns how long
        the thread may sleep before a rate-limited report falls due."""
        self._send_want()
        with self._send_lock:
            if self._sock is None:
                return IDLE_S
            with self._lock:
                report, wait = self._talk.next_report(now)
            if report is not None:
                self._queue(BROKER_CODEC.encode(report))
        return wait

    def _receive(self) -> bool:
        """Handle what the broker sent; False when the connection is gone."""
        sock = self._sock
        if sock is None:
            return False
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            messages = [BROKER_CODEC.decode(p) for p in self._reader.feed(data)]
        except ProtocolError as exc:
            log.error("bad message from the broker (%s): reconnecting", exc)
            return False
        return self._handle(messages)

    def _handle(self, messages: list[Message]) -> bool:
        """Apply the broker's messages; False when it closed the conversation."""
        for message in messages:
            if isinstance(message, Lease):
                self._apply_limit(message.limit)
            elif isinstance(message, Reclaim):
                self._reclaimed(message)
            elif isinstance(message, Refused):
                log.error("the broker closed our connection: %s", message.reason)
                return False
            else:
                log.error("unexpected %r from the broker: reconnecting", message.TYPE)
                return False
        return True

    def _apply_limit(self, limit: int) -> None:
        with self._lock:
            changed = self._talk.granted(limit, time.monotonic())
        if changed and self._holder is not None:
            self._holder.lease_changed(limit)

    def _reclaimed(self, reclaim: Reclaim) -> None:
        with self._lock:
            self._talk.reclaimed(reclaim)
        if self._holder is not None:
            self._holder.lease_changed(reclaim.limit)
