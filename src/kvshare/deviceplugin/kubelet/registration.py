"""Keeping the device plugin registered with the kubelet, through kubelet restarts.

A loop (``kvshare-plugin``) checks every ``poll_s``:

- each resource's socket is still ours (a starting kubelet deletes every socket in the
  device-plugin directory): if not, serve again on a fresh socket and re-register;
- ``kubelet.sock`` is the same socket as at our last registration, judged by inode *and*
  change time (a recreated socket often reuses the inode): if not, re-register;
- a ``ListAndWatch`` stream of the current registration that the kubelet ended also
  triggers a re-registration (the kubelet treats a closed stream as a failed plugin).
  Streams of an earlier registration, which the kubelet closes when we register again,
  do not count, or every re-registration would cause the next.

No kubelet (no directory or no socket) is not an error: the plugin says so once and
waits; the broker and metrics keep running without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from kvshare.api import names
from kvshare.deviceplugin.admin.metrics import NodeMetrics
from kvshare.deviceplugin.kubelet.kubelet_api import API_VERSION, pb, rpc
from kvshare.deviceplugin.kubelet.plugin import DeviceWatch, PluginServer, Resource

__all__ = ["PluginManager"]

log = logging.getLogger(__name__)


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


class PluginManager:
    """Serves every resource and keeps each registered with the kubelet."""

    def __init__(
        self,
        directory: Path,
        resources: Sequence[Resource],
        watch: DeviceWatch,
        metrics: NodeMetrics,
        *,
        poll_s: float = 0.5,
        register_timeout_s: float = 10.0,
    ) -> None:
        self.directory = directory
        self.kubelet_socket = directory / names.KUBELET_SOCKET_NAME
        self._watch = watch
        self._metrics = metrics
        self._poll = poll_s
        self._register_timeout = register_timeout_s
        self._servers = [
            PluginServer(r, directory, watch, metrics, self._stream_handler(r.name))
            for r in resources
        ]
        # _lock guards _registered_with, _registering_at and _stream_lost, written by the
        # loop and by gRPC stream threads.
        self._lock = threading.Lock()
        self._registered_with: dict[str, tuple[int, int, int]] = {}
        self._registering_at: dict[str, float] = {}
        self._stream_lost = False
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: str | None = None

    def start(self) -> None:
        """Start the registration loop."""
        self._thread = threading.Thread(target=self._run, name="kvshare-plugin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and remove our sockets."""
        self._stop.set()
        self._nudge.set()
        self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for server in self._servers:
            server.stop()
        for server in self._servers:
            self._metrics.plugin_registered.labels(server.resource.name).set(0)

    def registered(self) -> dict[str, bool]:
        """Resource name -> whether it is registered with the current kubelet."""
        with self._lock:
            return {
                s.resource.name: s.resource.name in self._registered_with for s in self._servers
            }

    def _stream_handler(self, name: str) -> Callable[[float], None]:
        def ended(started: float) -> None:
            with self._lock:
                current = name in self._registered_with
                if current and started >= self._registering_at.get(name, float("inf")):
                    self._stream_lost = True
            self._nudge.set()

        return ended

    def _say(self, message: str) -> None:
        """Log a state of the kubelet once, not every poll."""
        if message != self._said:
            self._said = message
            log.info("%s", message)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._check()
            except Exception:
                log.exception("device plugin: unexpected error; retrying")
            self._nudge.wait(self._poll)
            self._nudge.clear()

    def _check(self) -> None:
        if not self.directory.is_dir():
            self._forget_all()
            self._say(
                f"no kubelet device-plugin directory at {self.directory}: the device plugin "
                "waits for a kubelet; the broker and metrics keep running"
            )
            return
        kubelet = _identity(self.kubelet_socket)
        with self._lock:
            stream_lost, self._stream_lost = self._stream_lost, False
        for server in self._servers:
            if self._stop.is_set():
                return  # stop() removes the sockets: serving again would leave one behind
            if not server.serving():
                if server.resource.name in self._registered_with:
                    log.info("device plugin socket %s is gone: serving again", server.path)
                server.start()
                self._forget(server.resource.name)
        if kubelet is None:
            self._forget_all()
            self._say(
                f"no kubelet at {self.kubelet_socket}: the device plugin will register when it "
                "appears; the broker and metrics keep running"
            )
            return
        if stream_lost:
            log.info("the kubelet closed a ListAndWatch stream: registering again")
            self._forget_all()
        for server in self._servers:
            name = server.resource.name
            if self._registered_with.get(name) != kubelet:
                self._register(server, kubelet)

    def _register(self, server: PluginServer, kubelet: tuple[int, int, int]) -> None:
        name = server.resource.name
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=server.resource.endpoint,
            resource_name=name,
            options=pb.DevicePluginOptions(
                pre_start_required=False,
                get_preferred_allocation_available=server.resource.preferred_available,
            ),
        )
        with self._lock:
            # Streams the kubelet opens from now on belong to this registration.
            self._registering_at[name] = time.monotonic()
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                rpc.RegistrationStub(channel).Register(request, timeout=self._register_timeout)
        except grpc.RpcError as exc:
            self._metrics.plugin_registrations.labels(name, "failed").inc()
            self._say(
                f"registering {name} with the kubelet failed ({exc.code().name}: "
                f"{exc.details()}); retrying"
            )
            return
        with self._lock:
            self._registered_with[name] = kubelet
        self._said = None
        self._metrics.plugin_registrations.labels(name, "ok").inc()
        self._metrics.plugin_registered.labels(name).set(1)
        log.info(
            "registered %s with the kubelet (%d devices)", name, len(server.resource.devices())
        )

    def _forget(self, name: str) -> None:
        with self._lock:
            self._registered_with.pop(name, None)
        self._metrics.plugin_registered.labels(name).set(0)

    def _forget_all(self) -> None:
        for server in self._servers:
            self._forget(server.resource.name)
