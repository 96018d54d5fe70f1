"""The operator's HTTP endpoint: ``/metrics`` for Prometheus and ``/healthz`` for probes.

It runs on the operator's event loop, so ``/healthz`` answering at all shows the loop is
not stuck; it answers 503 until kopf has started the operator's handlers.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["HttpEndpoint"]

log = logging.getLogger(__name__)


class HttpEndpoint:
    """Serves ``/metrics`` from ``registry`` and ``/healthz`` on ``port`` (0: any free)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        self._registry = registry
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.started = False
        """Set once the operator is up; /healthz fails before."""

    async def _metrics(self, request: web.Request) -> web.Response:
        del request
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        del request
        if not self.started:
            return web.Response(status=503, text="starting\n")
        return web.Response(text="ok\n")

    async def start(self) -> int:
        """Start serving; returns the port it listens on."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = self._runner.addresses[0][1]
        log.info("serving /metrics and /healthz on port %d", port)
        return int(port)

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
