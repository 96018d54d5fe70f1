"""One rank of a coordinated tensor-parallel group: its memory, driven by the group's owner.

In vLLM one scheduler drives every TP worker. Each worker process runs a
:class:`RankServer`: it reserves the KV virtual range on its own device (the engine builds
its KV tensors from :meth:`RankServer.tensor`), listens on its own unix socket, and maps
exactly the pages the owner tells it to. The owner's pool
(:class:`~kvshare.runtime.coordinated.CoordinatedOwnership`) decides which pages; every
rank maps the same page ids, so block ids mean the same memory on every GPU.

Leases are per rank: each rank's memory is on its own GPU, so each rank holds the lease of
its own device (the broker knows it by its process) and forwards it to the owner, whose
pool runs against the smallest of them. The owner's wants and usage reports are passed on
to every rank's lease.

When the owner disconnects, the rank unmaps and releases every page (its memory goes back
to the device) and waits for a new owner.

Threads: one accept thread serves one owner connection at a time, handling its requests in
order. ``_send_lock`` serialises writes to the owner (replies from the accept thread,
limit changes from the lease's thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from kvshare.runtime.backends.base import Backend
from kvshare.runtime.errors import (
    BackendError,
    MapCountExceededError,
    OutOfDeviceMemoryError,
    PoolError,
)
from kvshare.runtime.geometry import KVGeometry
from kvshare.runtime.lease import LeaseSource, PoolUsage
from kvshare.runtime.ownership import check_rank
from kvshare.runtime.pages import PageSpace
from kvshare.runtime.paging import Paging
from kvshare.runtime.peer_protocol import (
    PAGE_OPS,
    ProtocolError,
    peer_uid,
    rank_socket_path,
    read_frame,
    write_frame,
)

if TYPE_CHECKING:
    import torch

__all__ = ["RankServer"]

log = logging.getLogger(__name__)


def _error_kind(exc: BackendError) -> str:
    if isinstance(exc, OutOfDeviceMemoryError):
        return "oom"
    if isinstance(exc, MapCountExceededError):
        return "map_limit"
    return "error"


class RankServer:
    """The memory of rank ``rank`` of a coordinated group, served to the group's owner.

    The server takes ownership of ``backend`` and ``lease``; :meth:`close` closes them.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        backend: Backend,
        lease: LeaseSource,
        *,
        group: str,
        rank: int,
        world_size: int,
        namespace: str | None = None,
        paging: Paging | None = None,
    ) -> None:
        check_rank(rank, world_size)
        self.geometry = geometry
        self.paging = paging or Paging()
        """What one page holds (block-outer or per-layer), and why: told to the lease."""
        self.backend = backend
        self.lease = lease
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.path = rank_socket_path(group, rank, namespace)
        self.space = PageSpace(geometry, backend)
        self._send_lock = threading.Lock()  # guards _owner and writes to it
        self._owner: socket.socket | None = None
        self._closed = threading.Event()
        try:
            self._listener = self._listen()
            lease.attach(self)
        except BaseException:
            self.space.close()
            raise
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvshare-rank-{rank}", daemon=True
        )
        self._thread.start()
        log.info("rank %d/%d of group %s listens on @%s", rank, world_size, group, self.path[1:])

    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PoolError(
                f"{self.path[1:]} is in use by another live rank {self.rank} of group "
                f"{self.group}; every rank of a group needs its own rank number"
            ) from None
        listener.listen(4)
        return listener

    # --- what the engine's worker uses ---------------------------------------------------

    def tensor(self, first_buffer: int, count: int = 1) -> torch.Tensor:
        """A zero-copy view of buffers ``[first_buffer, first_buffer + count)`` on this rank's
        device, shaped ``(count, num_blocks, block_bytes)`` as :meth:`KVPool.tensor`."""
        return self.space.tensor(first_buffer, count)

    def mapped_pages(self) -> frozenset[int]:
        """Page ids this rank has mapped now."""
        return self.space.mapped_pages()

    # --- the lease --------------------------------------------------------------------------

    def lease_changed(self, limit: int) -> None:
        """This rank's lease moved: tell the owner (whose pool honours the smallest)."""
        self._notify_owner({"op": "limit", "bytes": limit})

    def _notify_owner(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            if self._owner is None:
                return
            try:
                write_frame(self._owner, message)
            except OSError:
                log.warning("rank %d could not reach its owner", self.rank)

    def _report(self, usage: dict[str, Any]) -> None:
        page_bytes = self.geometry.page_bytes
        mapped = len(self.space.mapped_pages()) * page_bytes
        created = len(self.space.created_pages()) * page_bytes
        # The owner's pool decides what is mapped, so the lease in force is the one it
        # honoured: this rank's lease source acknowledges a reclaim only once it is.
        limit = usage.get("limit")
        self.lease.report(
            PoolUsage(
                mapped=mapped,
                used=min(int(usage.get("used", 0)), mapped),
                cached=min(int(usage.get("cached", 0)), mapped),
                reserved=created - mapped,
                limit=None if limit is None else int(limit),
                page_bytes=page_bytes,
                layout=self.paging.layout,
                layout_reason=self.paging.reason,
            )
        )

    # --- serving the owner ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break  # the listener was closed
            if peer_uid(conn) != os.getuid():
                log.warning("rank %d: refused an owner running as another user", self.rank)
                conn.close()
                continue
            with self._send_lock:
                self._owner = conn
            try:
                self._serve(conn)
            finally:
                with self._send_lock:
                    self._owner = None
                conn.close()
                self._release_everything()

    def _serve(self, conn: socket.socket) -> None:
        while True:
            try:
                message = read_frame(conn)
            except ProtocolError as exc:
                log.error(
                    "rank %d: bad message from the owner, connection closed: %s", self.rank, exc
                )
                return
            except OSError:
                return
            if message is None:
                return
            op = message.get("op")
            if "id" in message:
                reply = self._handle(op, message)
                reply["id"] = message["id"]
                with self._send_lock:
                    try:
                        write_frame(conn, reply)
                    except OSError:
                        return
            elif op == "want":
                self.lease.want(int(message["bytes"]))
            elif op == "report":
                self._report(message.get("usage") or {})
            else:
                log.error("rank %d: unknown notification %r, connection closed", self.rank, op)
                return

    def _handle(self, op: object, message: dict[str, Any]) -> dict[str, Any]:
        if op == "hello":
            return self._hello(message)
        if op in PAGE_OPS:
            pages = message.get("pages")
            if not isinstance(pages, list) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in pages
            ):
                return {"ok": False, "kind": "error", "message": f"{op}: pages must be ints"}
            try:
                getattr(self.space, str(op))(pages)
            except BackendError as exc:
                return {"ok": False, "kind": _error_kind(exc), "message": str(exc)}
            return {"ok": True}
        return {"ok": False, "kind": "error", "message": f"unknown request {op!r}"}

    def _hello(self, message: dict[str, Any]) -> dict[str, Any]:
        mine = dataclasses.asdict(self.geometry)
        if message.get("world_size") != self.world_size:
            problem = (
                f"the owner drives {message.get('world_size')} ranks, this rank belongs to a "
                f"group of {self.world_size}"
            )
        elif "geometry" in message and message["geometry"] != mine:
            problem = (
                f"the owner's KV geometry {message['geometry']} differs from this rank's {mine}"
            )
        else:
            return {
                "ok": True,
                "rank": self.rank,
                "world_size": self.world_size,
                "limit": self.lease.limit(),
                "mapped": sorted(self.space.mapped_pages()),
            }
        return {"ok": False, "kind": "config", "message": problem}

    def _release_everything(self) -> None:
        mapped = sorted(self.space.mapped_pages())
        created = sorted(self.space.created_pages())
        try:
            self.space.unmap(mapped)
            self.space.release(created)
        except BackendError:
            log.exception("rank %d could not release its pages", self.rank)
        if created:
            log.info("rank %d: owner gone, released %d pages", self.rank, len(created))
        self._report({})

    # --- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, release every page and the reservation, close lease and backend."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._send_lock:
            owner = self._owner
        if owner is not None:
            with contextlib.suppress(OSError):
                owner.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=30)
        self.space.close()
        self.lease.close()
        self.backend.close()

    def __enter__(self) -> RankServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
