"""The memory broker's server: unix sockets, one event loop, the books behind one lock.

One thread (``kvshare-broker``) owns every socket: it accepts, reads, decodes, applies
each message to the :class:`~kvshare.deviceplugin.broker.books.Books` and writes the
replies, through one ``epoll`` selector. A single loop needs no per-connection threads (which in
Python would hand the GIL back and forth on every message) and keeps the critical
section to the bookkeeping itself. ``_lock`` guards the books only; other threads (metrics
scrapes, the KVShareNode publisher, the audit, the device plugin) take it briefly to
read a view or record an audit result. Sockets and the connection tables are touched by
the loop thread only.

A pool's connection is bound to the process that opened it (``SO_PEERCRED``) and the
process is watched through a pidfd: when it exits, its lease returns at once. A
connection that closes without ``bye`` while its process lives on is given a short grace
(``orphan_grace_s``) to reconnect before its lease returns. Anything that breaks the
protocol (see :mod:`kvshare.api.wire`: every value is checked as it is decoded) closes
that one connection; it is counted, and logged at a bounded rate.

Every connection belongs to a tenant, the pod its process runs in (:mod:`.verification`):
limits count per pod and in all (:mod:`.connections.gate`); under Kubernetes a first
message is checked against what the pod was given (:mod:`.identity`), waiting briefly for
a pod not known yet. This module is the loop and the order of things; the parts it drives
are in :mod:`.connections`, :mod:`.state`, :mod:`.overrides` and :mod:`.config`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kvshare.api.wire import (
    BROKER_CODEC,
    Bye,
    Codec,
    Hello,
    Message,
    ProtocolError,
    Refused,
    TurnDone,
    TurnRequest,
    Welcome,
)
from kvshare.deviceplugin.broker import peers, pool_messages
from kvshare.deviceplugin.broker.books import Books, BrokerEvents, Send
from kvshare.deviceplugin.broker.config import BrokerConfig, BrokerError
from kvshare.deviceplugin.broker.connections import admin_requests, sockets
from kvshare.deviceplugin.broker.connections.conn import Conn
from kvshare.deviceplugin.broker.connections.gate import BrokerLimits, ConnectionGate
from kvshare.deviceplugin.broker.connections.listeners import Listeners
from kvshare.deviceplugin.broker.connections.pidfds import Kind, ProcessWatch
from kvshare.deviceplugin.broker.identity import PodDirectory, Refusal
from kvshare.deviceplugin.broker.overrides import PodPolicies, PodPolicy, PolicyState
from kvshare.deviceplugin.broker.policy import policy_named
from kvshare.deviceplugin.broker.state import AdmittedPools, load_expected
from kvshare.deviceplugin.broker.throttle import ThrottledLog
from kvshare.deviceplugin.broker.verification import WAIT, Verifier
from kvshare.deviceplugin.broker.views import BooksView
from kvshare.deviceplugin.inventory import GpuInfo

__all__ = ["Broker", "BrokerConfig", "BrokerError", "BrokerLimits"]

log = logging.getLogger(__name__)

_RECV_BYTES = 1 << 16
#: How often deadlines are checked (reclaims, orphaned connections, turns, recovery).
_TICK_S = 0.05


class Broker:
    """The node's memory broker: serves pools, start-up turns and admin requests."""

    def __init__(
        self,
        gpus: Iterable[GpuInfo],
        config: BrokerConfig,
        events: BrokerEvents | None = None,
    ) -> None:
        self.config = config
        self._gpus = list(gpus)
        self._events = events or BrokerEvents()
        self._lock = threading.Lock()  # guards _books (read by other threads via view())
        self._books = Books(self._gpus, headroom=config.headroom)
        self._selector = selectors.DefaultSelector()
        self._conns: dict[int, Conn] = {}
        self._pool_conns: dict[int, Conn] = {}
        self._turn_conns: dict[int, Conn] = {}
        self._processes = ProcessWatch(self._selector)
        self._admitted = AdmittedPools(config.state_path)
        # Policies changed in place (pod annotations): changed by the pod watch under
        # _lock, applied by the loop thread (see _apply_pod_policies).
        self._pod_policies = PodPolicies()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._serving = False
        self._error_log = ThrottledLog(log, "protocol errors")
        self._refusal_log = ThrottledLog(log, "refused connections")
        self._gate = ConnectionGate(config.limits)
        self._verifier = Verifier(config.verify)
        self._listeners = Listeners(self._selector, self._gate, self._verifier, self._count_refusal)
        # Connections whose first message waits for its pod to be known.
        self._verifying: dict[int, Conn] = {}
        # Reclaims asked for by lease enforcement (under _lock), made by the loop thread.
        self._overuse: list[tuple[int, int]] = []

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Restore expected pools from the state file, bind the sockets, start serving."""
        now = time.monotonic()
        expected = load_expected(self.config.state_path) if self.config.state_path else []
        with self._lock:
            self._books = Books(
                self._gpus,
                headroom=self.config.headroom,
                reclaim_deadline_s=self.config.reclaim_deadline_s,
                policy=policy_named(self.config.policy),
                turn_hold_s=self.config.turn_hold_s,
                orphan_grace_s=self.config.orphan_grace_s,
                orphan_wait_s=self.config.orphan_wait_s,
                events=self._events,
                expected=expected,
                recovery_deadline=now + self.config.recovery_s,
            )
        if expected:
            log.info(
                "waiting up to %.0f s for %d pool(s) of the previous broker to re-declare",
                self.config.recovery_s,
                len(expected),
            )
        self._listen(self.config.socket_path, 0o666, "pool")
        if self.config.admin_path is not None:
            # Its directory (no pod mounts it) is made 0700 by the node agent.
            self._listen(self.config.admin_path, 0o600, "admin")
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", 0))
        for pool in expected:
            self._watch_pid(pool.pid, "expected", pool.pid)
        self._serving = True
        self._thread = threading.Thread(target=self._run, name="kvshare-broker", daemon=True)
        self._thread.start()
        log.info("memory broker listening on %s", self.config.socket_path)

    def stop(self) -> None:
        """Stop serving and remove the sockets. Pools keep their memory and reconnect to
        the next broker; the state file stays for it."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._processes.close()
        self._listeners.close()
        self._serving = False
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _listen(self, path: Path, mode: int, kind: str) -> None:
        try:
            self._listeners.listen(path, mode, kind)
        except sockets.ListenError as exc:
            raise BrokerError(str(exc)) from None

    # --- what other threads may ask -----------------------------------------------------

    def view(self) -> BooksView:
        """The books as of now."""
        with self._lock:
            return self._books.view(time.monotonic())

    def record_audit(self, results: Iterable[tuple[int, int | None, bool]]) -> list[str]:
        """Store audit results ``(pool id, device bytes, over lease)``; returns the names
        of pools that just went over their lease."""
        flagged = []
        with self._lock:
            for pool_id, device_bytes, over in results:
                if self._books.record_audit(pool_id, device_bytes, over):
                    record = self._books.pool(pool_id)
                    flagged.append(record.name if record else str(pool_id))
        return flagged

    def reclaim_overuse(self, pool_id: int, excess: int) -> None:
        """Reclaim ``excess`` bytes of pool ``pool_id``'s lease, which its process holds
        beyond its charge on the device (lease enforcement); done by the loop thread."""
        with self._lock:
            self._overuse.append((pool_id, excess))
        self._wake()

    def set_pod_policy(self, pod_uid: str, policy: PodPolicy | None) -> None:
        """Pod ``pod_uid``'s annotated KV policy (from the pod watch): applied to its pools
        now and to the pools it opens later; ``None``: the pod is gone."""
        with self._lock:
            changed = self._pod_policies.set(pod_uid, policy)
        if changed:
            self._wake()

    def set_pod_directory(self, directory: PodDirectory) -> None:
        """What the pods of this node are and were given (used with ``config.verify``)."""
        self._verifier.directory = directory

    def pods_changed(self) -> None:
        """The pod directory learnt something: hellos waiting for their pod try again."""
        self._wake()

    def pod_policy_states(self) -> dict[int, PolicyState]:
        """Pool id -> the KV policy it runs under (for the KVShareNode)."""
        with self._lock:
            return self._pod_policies.states()

    def set_health(self, gpu_uuid: str, healthy: bool) -> None:
        """A GPU's health changed (from the inventory)."""
        with self._lock:
            self._books.set_healthy(gpu_uuid, healthy)

    @property
    def alive(self) -> bool:
        """The loop turned within the last few seconds, or turns when woken now (an agent
        stopped and continued has all its threads stale at once: the one asking must not
        take the loop for stuck before it had a chance to turn)."""
        if not self._serving:
            return False
        seen = self._beat
        if time.monotonic() - seen < 5.0:
            return True
        self._wake()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if self._beat != seen:
                return True
            time.sleep(0.01)
        return False

    @property
    def ready(self) -> bool:
        """Serving, and not waiting for pools of a previous broker."""
        if not self.alive:
            return False
        with self._lock:
            return not self._books.recovering

    # --- the loop -----------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            self._beat = now
            if now >= next_tick:
                # Deadlines (reclaims, orphans, turns, recovery) are checked on a short
                # period rather than per message, keeping the per-message path small.
                self._tick()
                next_tick = now + _TICK_S
            events = self._selector.select(max(next_tick - now, 0.0))
            # The loop turns: a stopped agent (SIGSTOP) that runs again is alive at once,
            # not only once it has worked through what queued meanwhile.
            self._beat = time.monotonic()
            # New connections and admin requests first: after a stop, pools' reports have
            # queued too, and `kvshare ctl` should not wait behind all of them.
            events.sort(key=self._urgency)
            for key, mask in events:
                kind, value = key.data
                try:
                    if kind == "conn":
                        conn = self._conns.get(value)
                        if conn is not None:
                            if mask & selectors.EVENT_WRITE:
                                self._flush(conn)
                            if mask & selectors.EVENT_READ and conn.role != "closed":
                                self._read(conn)
                    elif kind == "listen":
                        self._accept(key.fileobj, value)  # type: ignore[arg-type]
                    elif kind == "pidfd":
                        self._process_exited(key.fd)
                    elif kind == "wake":
                        sockets.drain(self._wake_r)
                        self._apply_pod_policies()
                        self._apply_overuse()
                        self._retry_waiting(time.monotonic())
                except Exception:
                    # One bad event must never take the broker down.
                    log.exception("broker: unexpected error handling %s event", kind)

    def _urgency(self, event: tuple[selectors.SelectorKey, int]) -> int:
        """0 for new connections and admin requests, 1 for the rest."""
        kind, value = event[0].data
        if kind == "listen":
            return 0
        conn = self._conns.get(value) if kind == "conn" else None
        return 0 if conn is not None and conn.role in ("admin", "new") else 1

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            sends, removed = self._books.tick(now)
        for pool_id in removed:
            self._forget_pool(pool_id)
        self._deliver(sends)
        for conn_id in self._gate.overdue(now):
            conn = self._conns.get(conn_id)
            if conn is not None and conn.role == "new":
                late = f"deadline: no first message within {self._gate.limits.hello_deadline_s:g} s"
                self._refuse_untrusted(conn, Refusal("deadline", late))
        self._retry_waiting(now)
        self._listeners.resume(now)
        self._error_log.flush()
        self._refusal_log.flush()

    def _accept(self, listener: socket.socket, kind: str) -> None:
        for conn in self._listeners.accept(listener, kind):
            self._conns[conn.id] = conn

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        codec: Codec = admin_requests.ADMIN_CODEC if conn.role == "admin" else BROKER_CODEC
        try:
            for payload in conn.reader.feed(data):
                self._dispatch(conn, codec.decode(payload))
                if conn.role == "closed":
                    return
        except ProtocolError as exc:
            self._reject(conn, exc)
        except Exception:
            # A fault of the broker's own: the peer that triggered it loses only its
            # connection, and the next one is served.
            self._error_log.log(
                logging.ERROR,
                "broker: unexpected error serving pid %d: closing its connection",
                conn.peer.pid,
                exc_info=True,
            )
            self._refuse(conn, "internal error in the broker: see the node agent's log")

    def _dispatch(self, conn: Conn, message: Message) -> None:
        now = time.monotonic()
        if conn.role == "pool":
            with self._lock:
                sends = pool_messages.apply(self._books, conn.pool_id, message, now)
            if isinstance(message, Bye):
                self._forget_pool(conn.pool_id)
            self._deliver(sends)
        elif conn.role == "new":
            if not isinstance(message, Hello | TurnRequest):
                raise ProtocolError(
                    f"a connection must start with hello or turn-request, not {message.TYPE!r}"
                )
            conn.pending = message
            conn.wait_until = now + self._gate.limits.identity_wait_s
            self._first_message(conn, now)
        elif conn.role == "verifying":
            raise ProtocolError(f"{message.TYPE!r} sent before the first message was answered")
        elif conn.role == "turn":
            if not isinstance(message, TurnDone):
                raise ProtocolError(f"{message.TYPE!r} is not allowed on a turn connection")
            with self._lock:
                sends = self._books.turn_done(conn.id, now)
            self._turn_conns.pop(conn.id, None)
            self._drop(conn)
            self._deliver(sends)
        elif conn.role == "admin":
            self._admin(conn, message, now)

    def _first_message(self, conn: Conn, now: float) -> None:
        """Check the connection's first message against its pod; go on with it, refuse
        it, or let it wait for its pod to be known."""
        message = conn.pending
        if message is None:
            return
        with self._lock:
            verdict = self._verifier.check(conn.tenant, conn.peer.pid, message, self._books.pools())
        if verdict is WAIT:
            if now < conn.wait_until:
                conn.role = "verifying"
                self._verifying[conn.id] = conn
                return
            verdict = self._verifier.unknown(conn.tenant)
        self._verifying.pop(conn.id, None)
        conn.pending = None
        if isinstance(verdict, Refusal):
            self._refuse_untrusted(conn, verdict)
        elif isinstance(verdict, Hello):
            conn.role = "new"
            self._hello(conn, verdict, now)
        elif isinstance(verdict, TurnRequest):
            conn.role = "turn"
            self._turn_conns[conn.id] = conn
            with self._lock:
                sends = self._books.turn_request(conn.id, verdict, conn.peer.pid, now)
            self._deliver(sends)

    def _retry_waiting(self, now: float) -> None:
        for conn in list(self._verifying.values()):
            self._first_message(conn, now)

    def _hello(self, conn: Conn, hello: Hello, now: float) -> None:
        with self._lock:
            problem = self._gate.pool_refusal(
                conn.tenant.key, conn.peer.pid, hello, self._books.pools()
            )
        if problem is not None:
            self._events.refused(hello.gpu, "limit")
            self._refuse_untrusted(conn, Refusal("pool-limit", problem))
            return
        with self._lock:
            admission = self._books.admit(hello, conn.peer.pid, now)
            if admission.record is not None:
                admission.sends.extend(
                    self._pod_policies.admitted(self._books, admission.record, now)
                )
        record = admission.record
        if record is None:
            self._refuse(conn, admission.reason)
            self._deliver(admission.sends)
            return
        previous = self._pool_conns.get(record.id)
        if previous is not None and previous is not conn:
            # The pool reconnected before its old connection was seen to close.
            previous.role = "closed"
            self._drop(previous)
        conn.role = "pool"
        conn.pool_id = record.id
        self._pool_conns[record.id] = conn
        self._gate.pool_added(conn.tenant.key, record.id)
        if not self._processes.watches_pool(record.id):
            self._watch_pid(conn.peer.pid, "pool", record.id)
        self._admitted.remember(record, peers.process_start_time(record.pid))
        self._admitted.save()
        self._send(
            conn,
            Welcome(pool_id=record.id, name=record.name, lease=record.lease, kv_max=record.kv_max),
        )
        self._deliver(admission.sends)

    def _apply_overuse(self) -> None:
        sends: list[Send] = []
        with self._lock:
            for pool_id, excess in self._overuse:
                sends += self._books.reclaim_overuse(pool_id, excess, time.monotonic())
            self._overuse = []
        self._deliver(sends)

    def _apply_pod_policies(self) -> None:
        """Apply the pods' changed KV policies to their pools (loop thread)."""
        with self._lock:
            sends, touched = self._pod_policies.apply_changed(self._books, time.monotonic())
        for record in touched:
            self._admitted.refresh(record)
        if touched:
            self._admitted.save()
        self._deliver(sends)

    def _admin(self, conn: Conn, message: Message, now: float) -> None:
        with self._lock:
            reply, sends, problem = admin_requests.answer(self._books, message, conn.peer, now)
        if problem is not None:
            self._count_refusal(conn.peer.pid, Refusal("admin", problem))
        self._send(conn, reply, admin_requests.ADMIN_CODEC)
        self._deliver(sends)

    # --- sending ------------------------------------------------------------------------

    def _deliver(self, sends: list[Send]) -> None:
        for send in sends:
            table = self._pool_conns if send.to == "pool" else self._turn_conns
            conn = table.get(send.key)
            if conn is not None:
                self._send(conn, send.message)

    def _send(self, conn: Conn, message: Message, codec: Codec = BROKER_CODEC) -> None:
        if conn.role == "closed":
            return
        try:
            frame = codec.encode(message)
        except ProtocolError as exc:
            log.error("broker: cannot send %s to pid %d: %s", message.TYPE, conn.peer.pid, exc)
            self._refuse(conn, f"the node agent cannot send its {message.TYPE}: {exc}")
            return
        if not conn.write(frame, self._selector):
            self._close(conn)
            return
        if conn.overflowing(len(frame)):
            log.warning("broker: pid %d does not read its messages: disconnecting", conn.peer.pid)
            self._close(conn)

    def _flush(self, conn: Conn) -> None:
        if not conn.flush(self._selector):
            self._close(conn)

    # --- closing ------------------------------------------------------------------------

    def _reject(self, conn: Conn, error: ProtocolError) -> None:
        self._events.protocol_error(error.kind)
        # The message quotes the peer's values escaped and cut short
        # (kvshare.api.wire.errors.shown).
        self._error_log.log(
            logging.WARNING, "broker: closing connection from pid %d: %s", conn.peer.pid, error
        )
        self._refuse(conn, f"protocol error: {error}")

    def _refuse_untrusted(self, conn: Conn, refusal: Refusal) -> None:
        """Refuse a connection that a check of its pod or its limits did not pass."""
        self._count_refusal(conn.peer.pid, refusal)
        self._refuse(conn, refusal.message)

    def _count_refusal(self, pid: int, refusal: Refusal) -> None:
        self._events.trust_refused(refusal.reason)
        self._refusal_log.log(
            logging.WARNING, "broker: refused pid %d: %s", pid, refusal.message[:300]
        )

    def _refuse(self, conn: Conn, reason: str) -> None:
        """Tell the peer why, then close (a pool connection then counts as lost)."""
        if conn.role in ("new", "verifying", "pool", "turn", "admin"):
            with contextlib.suppress(OSError):
                conn.sock.send(BROKER_CODEC.encode(Refused(reason=reason[:2000])))
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        """The connection ended without a goodbye."""
        role = conn.role
        bound = role == "pool" and self._pool_conns.get(conn.pool_id) is conn
        self._drop(conn)
        now = time.monotonic()
        if bound:
            # Watched processes keep their lease until they exit (their memory is only
            # free then) or reconnect; unwatched ones get the short grace.
            watched = self._processes.watches_pool(conn.pool_id)
            with self._lock:
                self._books.orphan(conn.pool_id, now, watched=watched)
        elif role == "turn":
            self._turn_conns.pop(conn.id, None)
            with self._lock:
                sends = self._books.turn_done(conn.id, now)
            self._deliver(sends)

    def _drop(self, conn: Conn) -> None:
        if conn.role == "pool" and self._pool_conns.get(conn.pool_id) is conn:
            del self._pool_conns[conn.pool_id]
        conn.role = "closed"
        self._verifying.pop(conn.id, None)
        if self._conns.pop(conn.id, None) is not None:
            self._gate.closed(conn.tenant.key)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()

    # --- processes ----------------------------------------------------------------------

    def _watch_pid(self, pid: int, kind: Kind, key: int) -> None:
        if not self._processes.watch(pid, kind, key):
            self._on_exit(kind, key)

    def _process_exited(self, fd: int) -> None:
        kind, key = self._processes.unwatch(fd)
        self._on_exit(kind, key)

    def _on_exit(self, kind: Kind, key: int) -> None:
        now = time.monotonic()
        with self._lock:
            if kind == "pool":
                sends = self._books.remove(key, "process exited", now)
            else:
                sends = self._books.forget_expected(key, now)
        if kind == "pool":
            self._forget_pool(key)
        self._deliver(sends)

    def _forget_pool(self, pool_id: int) -> None:
        self._processes.unwatch_pool(pool_id)
        self._gate.pool_removed(pool_id)
        conn = self._pool_conns.pop(pool_id, None)
        if conn is not None:
            self._drop(conn)
        with self._lock:
            self._pod_policies.forget_pool(pool_id)
        if self._admitted.forget(pool_id):
            self._admitted.save()
