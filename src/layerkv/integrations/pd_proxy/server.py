"""aiohttp's low-level HTTP server with the two things the proxy adds to it: a bound on open
client connections (one over `max_connections` is closed at accept, before any read) and JSON
errors for the requests aiohttp's own parser refuses (a bad Content-Length, a head too large:
400, in the shape of bodies.error_body). No HTTP parsing here: aiohttp parses. The proxy's event
loop only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web, web_protocol

from layerkv.integrations.pd_proxy.bodies import error_response
from layerkv.integrations.pd_proxy.metrics import Outcome, ProxyMetrics

log = logging.getLogger(__name__)


class _Protocol(web_protocol.RequestHandler):
    """aiohttp's connection protocol; only its error answers differ (JSON, counted)."""

    metrics: ProxyMetrics

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("pd-proxy: error handling a request from %s", request.remote, exc_info=exc)
        else:
            log.debug("pd-proxy: refused a malformed request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:  # as aiohttp's: an answer started cannot become an error
            raise ConnectionError("the answer was sent already: cannot send an error after it")
        self.metrics.count(Outcome.BAD_REQUEST if status < 500 else Outcome.INTERNAL_ERROR)
        text = (getattr(exc, "message", "") or message or str(exc or "")).strip() or "malformed request"
        response = error_response(status, f"malformed request: {text}" if status < 500 else "internal error (logged)")
        response.force_close()
        return response


class ProxyServer(web.Server):
    """web.Server whose connections are `_Protocol`s, at most `max_connections` open."""

    def __init__(self, handler: Any, *, max_connections: int, metrics: ProxyMetrics, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.max_connections, self.metrics = max_connections, metrics
        metrics.connections.set_function(lambda: len(self._connections))

    def __call__(self) -> _Protocol:
        protocol = _Protocol(self, loop=self._loop, **self._kwargs)
        protocol.metrics = self.metrics
        return protocol

    def connection_made(self, handler: web_protocol.RequestHandler, transport: asyncio.Transport) -> None:
        if len(self._connections) >= self.max_connections:
            self.metrics.refused.inc()
            transport.abort()  # its connection_lost finds it unregistered
            return
        super().connection_made(handler, transport)
