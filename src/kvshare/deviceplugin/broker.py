"""The memory broker's server: unix sockets, one event loop, the books behind one lock.

Concurrency
-----------
One thread (``kvshare-broker``) owns every socket: it accepts, reads, decodes, applies
each message to the :class:`~kvshare.deviceplugin.books.Books` and writes the replies,
through one ``epoll`` selector. A single loop needs no per-connection threads (which in
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
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvshare.api.wire import (
    BROKER_CODEC,
    MAX_REQUEST_BYTES,
    Bye,
    Codec,
    FrameReader,
    Hello,
    Message,
    ProtocolError,
    Refused,
    Report,
    TurnDone,
    TurnRequest,
    Want,
    Welcome,
)
from kvshare.deviceplugin import admin, peers
from kvshare.deviceplugin.books import Books, BrokerEvents, ExpectedPool, PoolRecord, Send
from kvshare.deviceplugin.inventory import GpuInfo
from kvshare.deviceplugin.pod_policies import PodPolicies, PodPolicy, PolicyState
from kvshare.deviceplugin.policy import DEFAULT_POLICY, policy_named
from kvshare.deviceplugin.state import load_expected, save_pools
from kvshare.deviceplugin.throttle import ThrottledLog
from kvshare.deviceplugin.views import BooksView

__all__ = ["Broker", "BrokerConfig", "BrokerError"]

log = logging.getLogger(__name__)

#: A peer that lets this much unsent data pile up is not reading: it is disconnected.
_MAX_OUTBOX_BYTES = 1 << 20
#: Pools one process may hold at once. An engine process holds one per GPU it drives;
#: the limit keeps one misbehaving process from filling the books (and every listing).
MAX_POOLS_PER_PROCESS = 64
_RECV_BYTES = 1 << 16
#: How often deadlines are checked (reclaims, orphaned connections, turns, recovery).
_TICK_S = 0.05


class BrokerError(RuntimeError):
    """The broker cannot start; the message says what to change."""


@dataclass(frozen=True)
class BrokerConfig:
    """Where the broker listens and how it lends."""

    socket_path: Path
    admin_path: Path | None = None
    state_path: Path | None = None
    headroom: int = 512 * 2**20
    reclaim_deadline_s: float = 10.0
    policy: str = DEFAULT_POLICY
    """The broker policy's name (:data:`kvshare.deviceplugin.policy.POLICIES`)."""
    turn_hold_s: float = 600.0
    orphan_grace_s: float = 0.5
    orphan_wait_s: float = 10.0
    recovery_s: float = 10.0


Role = Literal["new", "pool", "turn", "admin", "closed"]


class _Conn:
    """One accepted connection (loop thread only)."""

    __slots__ = ("id", "out", "peer", "pool_id", "reader", "role", "sock")

    def __init__(self, conn_id: int, sock: socket.socket, peer: peers.Peer, role: Role) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer = peer
        self.role: Role = role
        self.reader = FrameReader(MAX_REQUEST_BYTES)
        self.out = bytearray()
        self.pool_id = 0


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
        self._conns: dict[int, _Conn] = {}
        self._pool_conns: dict[int, _Conn] = {}
        self._turn_conns: dict[int, _Conn] = {}
        self._pidfds: dict[int, tuple[Literal["pool", "expected"], int]] = {}
        self._pool_pidfds: dict[int, int] = {}
        self._admitted: dict[int, tuple[ExpectedPool, int | None]] = {}
        # Policies changed in place (pod annotations): changed by the pod watch under
        # _lock, applied by the loop thread (see _apply_pod_policies).
        self._pod_policies = PodPolicies()
        self._listeners: list[tuple[socket.socket, Path]] = []
        self._next_conn_id = 1
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._serving = False
        self._error_log = ThrottledLog(log, "protocol errors")

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
        for fd in list(self._pidfds):
            self._unwatch_pidfd(fd)
        for sock, path in self._listeners:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._listeners.clear()
        self._serving = False
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _listen(self, path: Path, mode: int, kind: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BrokerError(
                f"cannot create {path.parent} for the {kind} socket ({exc.strerror}): "
                "choose a writable path (--broker-socket / KVSHARE_BROKER_SOCKET, --admin-socket)"
            ) from None
        if len(os.fsencode(path)) >= 108:
            raise BrokerError(f"socket path {path} is too long for a unix socket (max 107 bytes)")
        if path.exists() or path.is_symlink():
            if stat.S_ISSOCK(path.lstat().st_mode) and _answers(path):
                raise BrokerError(f"another node agent is already serving at {path}")
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(path))
            os.chmod(path, mode)
            sock.listen(512)
        except OSError as exc:
            sock.close()
            raise BrokerError(f"cannot listen on {path}: {exc.strerror}") from None
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, ("listen", kind))
        self._listeners.append((sock, path))

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

    def set_pod_policy(self, pod_uid: str, policy: PodPolicy | None) -> None:
        """Pod ``pod_uid``'s annotated KV policy (from the pod watch): applied to its pools
        now and to the pools it opens later; ``None``: the pod is gone."""
        with self._lock:
            changed = self._pod_policies.set(pod_uid, policy)
        if changed:
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
        """The loop turned within the last few seconds."""
        return self._serving and time.monotonic() - self._beat < 5.0

    @property
    def ready(self) -> bool:
        """Serving, and not waiting for pools of a previous broker."""
        with self._lock:
            return self.alive and not self._books.recovering

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
            for key, mask in self._selector.select(max(next_tick - now, 0.0)):
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
                        _drain(self._wake_r)
                        self._apply_pod_policies()
                except Exception:
                    # One bad event must never take the broker down.
                    log.exception("broker: unexpected error handling %s event", kind)

    def _tick(self) -> None:
        with self._lock:
            sends, removed = self._books.tick(time.monotonic())
        for pool_id in removed:
            self._forget_pool(pool_id)
        self._deliver(sends)
        self._error_log.flush()

    def _accept(self, listener: socket.socket, kind: str) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("broker: out of file descriptors, cannot accept: %s", exc)
                return
            sock.setblocking(False)
            try:
                peer = peers.peer_of(sock)
            except OSError:
                sock.close()
                continue
            conn_id = self._next_conn_id
            self._next_conn_id += 1
            conn = _Conn(conn_id, sock, peer, "admin" if kind == "admin" else "new")
            self._conns[conn_id] = conn
            self._selector.register(sock, selectors.EVENT_READ, ("conn", conn_id))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        codec: Codec = admin.ADMIN_CODEC if conn.role == "admin" else BROKER_CODEC
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

    def _dispatch(self, conn: _Conn, message: Message) -> None:
        now = time.monotonic()
        if conn.role == "pool":
            pool_id = conn.pool_id
            if isinstance(message, Want):
                if message.seq <= 0:
                    raise ProtocolError("want: seq must be > 0")
                with self._lock:
                    sends = self._books.want(pool_id, message.seq, message.total, now)
                self._deliver(sends)
            elif isinstance(message, Report):
                sizes = (message.mapped, message.used, message.cached, message.reserved)
                if min(*sizes, message.page_bytes) < 0:
                    raise ProtocolError("report: sizes must be >= 0")
                with self._lock:
                    sends = self._books.report(pool_id, message, now)
                self._deliver(sends)
            elif isinstance(message, Bye):
                with self._lock:
                    sends = self._books.remove(pool_id, "bye", now)
                self._forget_pool(pool_id)
                self._deliver(sends)
            else:
                raise ProtocolError(f"{message.TYPE!r} is not allowed on a pool connection")
        elif conn.role == "new":
            if isinstance(message, Hello):
                self._hello(conn, message, now)
            elif isinstance(message, TurnRequest):
                conn.role = "turn"
                self._turn_conns[conn.id] = conn
                with self._lock:
                    sends = self._books.turn_request(conn.id, message, conn.peer.pid, now)
                self._deliver(sends)
            else:
                raise ProtocolError(
                    f"a connection must start with hello or turn-request, not {message.TYPE!r}"
                )
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

    def _hello(self, conn: _Conn, hello: Hello, now: float) -> None:
        refusal = self._peer_problem(conn.peer, hello) or self._too_many_pools(conn.peer, hello)
        if refusal is not None:
            self._events.refused(hello.gpu, "peer")
            self._refuse(conn, refusal)
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
        if record.id not in self._pool_pidfds:
            self._watch_pid(conn.peer.pid, "pool", record.id)
        self._remember(record, peers.process_start_time(record.pid))
        self._save_state()
        self._send(
            conn,
            Welcome(pool_id=record.id, name=record.name, lease=record.lease, kv_max=record.kv_max),
        )
        self._deliver(admission.sends)

    def _remember(self, record: PoolRecord, started: int | None) -> None:
        """What a restarted broker expects pool ``record`` to re-declare."""
        self._admitted[record.id] = (
            ExpectedPool(
                pid=record.pid,
                name=record.name,
                gpu=record.gpu,
                static=record.static,
                kv_min=record.kv_min,
            ),
            started,
        )

    def _apply_pod_policies(self) -> None:
        """Apply the pods' changed KV policies to their pools (loop thread)."""
        with self._lock:
            sends, touched = self._pod_policies.apply_changed(self._books, time.monotonic())
        for record in touched:
            if record.id in self._admitted:
                self._remember(record, self._admitted[record.id][1])
        if touched:
            self._save_state()
        self._deliver(sends)

    @staticmethod
    def _peer_problem(peer: peers.Peer, hello: Hello) -> str | None:
        if peer.pid <= 0:
            return (
                "peer: the broker cannot see your process (another pid namespace): run the "
                "node agent with hostPID"
            )
        if hello.pod_uid and peers.in_pod(peer.pid, hello.pod_uid) is False:
            return f"peer: process {peer.pid} does not run in pod {hello.pod_uid}"
        return None

    def _too_many_pools(self, peer: peers.Peer, hello: Hello) -> str | None:
        with self._lock:
            mine = [p for p in self._books.pools() if p.pid == peer.pid]
        if len(mine) < MAX_POOLS_PER_PROCESS or any(
            p.hello.pod == hello.pod and p.hello.rank == hello.rank for p in mine
        ):  # a pool reconnecting replaces its own record
            return None
        return (
            f"peer: process {peer.pid} already holds {len(mine)} pools, the most one process "
            "may hold; close some (each engine process needs one per GPU)"
        )

    def _admin(self, conn: _Conn, message: Message, now: float) -> None:
        if not isinstance(message, admin.AdminRequest):
            raise ProtocolError(f"{message.TYPE!r} is not an admin request")
        problem = None
        if conn.peer.uid not in (0, os.geteuid()):
            problem = f"admin requests need uid 0 or {os.geteuid()}, not {conn.peer.uid}"
        elif peers.same_mount_namespace(conn.peer.pid) is False:
            problem = "admin requests are only taken from the node agent's own container"
        sends: list[Send] = []
        if problem is not None:
            reply = admin.AdminReply(ok=False, error=problem)
        else:
            with self._lock:
                reply, sends = admin.execute(self._books, message, now)
        self._send(conn, reply, admin.ADMIN_CODEC)
        self._deliver(sends)

    # --- sending ------------------------------------------------------------------------

    def _deliver(self, sends: list[Send]) -> None:
        for send in sends:
            table = self._pool_conns if send.to == "pool" else self._turn_conns
            conn = table.get(send.key)
            if conn is not None:
                self._send(conn, send.message)

    def _send(self, conn: _Conn, message: Message, codec: Codec = BROKER_CODEC) -> None:
        if conn.role == "closed":
            return
        try:
            frame = codec.encode(message)
        except ProtocolError as exc:
            log.error("broker: cannot send %s to pid %d: %s", message.TYPE, conn.peer.pid, exc)
            self._refuse(conn, f"the node agent cannot send its {message.TYPE}: {exc}")
            return
        if conn.out:
            conn.out += frame
        else:
            try:
                sent = conn.sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent < len(frame):
                conn.out += frame[sent:]
                self._selector.modify(
                    conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("conn", conn.id)
                )
        if len(conn.out) > max(_MAX_OUTBOX_BYTES, len(frame)):  # one admin reply may be more
            log.warning("broker: pid %d does not read its messages: disconnecting", conn.peer.pid)
            self._close(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del conn.out[:sent]
        if not conn.out:
            self._selector.modify(conn.sock, selectors.EVENT_READ, ("conn", conn.id))

    # --- closing ------------------------------------------------------------------------

    def _reject(self, conn: _Conn, error: ProtocolError) -> None:
        self._events.protocol_error(error.kind)
        # The message quotes the peer's values escaped and cut short (see wire._shown).
        self._error_log.log(
            logging.WARNING, "broker: closing connection from pid %d: %s", conn.peer.pid, error
        )
        self._refuse(conn, f"protocol error: {error}")

    def _refuse(self, conn: _Conn, reason: str) -> None:
        """Tell the peer why, then close (a pool connection then counts as lost)."""
        if conn.role in ("new", "pool", "turn", "admin"):
            with contextlib.suppress(OSError):
                conn.sock.send(BROKER_CODEC.encode(Refused(reason=reason[:2000])))
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        """The connection ended without a goodbye."""
        role = conn.role
        bound = role == "pool" and self._pool_conns.get(conn.pool_id) is conn
        self._drop(conn)
        now = time.monotonic()
        if bound:
            # Watched processes keep their lease until they exit (their memory is only
            # free then) or reconnect; unwatched ones get the short grace.
            watched = conn.pool_id in self._pool_pidfds
            with self._lock:
                self._books.orphan(conn.pool_id, now, watched=watched)
        elif role == "turn":
            self._turn_conns.pop(conn.id, None)
            with self._lock:
                sends = self._books.turn_done(conn.id, now)
            self._deliver(sends)

    def _drop(self, conn: _Conn) -> None:
        if conn.role == "pool" and self._pool_conns.get(conn.pool_id) is conn:
            del self._pool_conns[conn.pool_id]
        conn.role = "closed"
        if self._conns.pop(conn.id, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()

    # --- processes ----------------------------------------------------------------------

    def _watch_pid(self, pid: int, kind: Literal["pool", "expected"], key: int) -> None:
        try:
            fd = peers.open_pidfd(pid)
        except ProcessLookupError:
            self._on_exit(kind, key)
            return
        if fd is None:
            return
        self._pidfds[fd] = (kind, key)
        if kind == "pool":
            self._pool_pidfds[key] = fd
        self._selector.register(fd, selectors.EVENT_READ, ("pidfd", fd))

    def _unwatch_pidfd(self, fd: int) -> None:
        kind, key = self._pidfds.pop(fd)
        if kind == "pool":
            self._pool_pidfds.pop(key, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        os.close(fd)

    def _process_exited(self, fd: int) -> None:
        kind, key = self._pidfds[fd]
        self._unwatch_pidfd(fd)
        self._on_exit(kind, key)

    def _on_exit(self, kind: str, key: int) -> None:
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
        fd = self._pool_pidfds.get(pool_id)
        if fd is not None:
            self._unwatch_pidfd(fd)
        conn = self._pool_conns.pop(pool_id, None)
        if conn is not None:
            self._drop(conn)
        with self._lock:
            self._pod_policies.forget_pool(pool_id)
        if self._admitted.pop(pool_id, None) is not None:
            self._save_state()

    def _save_state(self) -> None:
        if self.config.state_path is None:
            return
        try:
            save_pools(self.config.state_path, self._admitted.values())
        except OSError as exc:
            log.error("cannot write broker state %s: %s", self.config.state_path, exc)


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
