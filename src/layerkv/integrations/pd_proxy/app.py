"""The proxy's request handler: a completion goes to a prefill server (one token), then with the
prefill's kv_transfer_params to a decode server, whose answer streams through to the client as
it comes. Everything else goes to a decode server as it is, except the proxy's own `/metrics`
and `/health`. One handler task per request on the proxy's event loop (aiohttp's); a client
that goes away cancels its task, and with it the upstream call.

Failure rules: a prefill that fails costs only the prefill (the decode server computes the whole
prompt; `X-LayerKV-Prefill: failed`). A decode server that fails before its answer started is
retried once on another; one that fails after cuts the client's stream. Transport errors,
timeouts and 502/503/504 take a server out of rotation (routing.py); other answers are the
server's answer to this request and pass through."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from layerkv.integrations.pd_proxy.bodies import (
    ProxyError,
    completion_request,
    decode_body,
    error_response,
    prefill_body,
    read_body,
    retry_after,
)
from layerkv.integrations.pd_proxy.config import ProxyConfig
from layerkv.integrations.pd_proxy.metrics import Outcome, ProxyMetrics
from layerkv.integrations.pd_proxy.routing import Pool, Upstream

log = logging.getLogger(__name__)
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "Accept")  # what the upstreams get of a client's headers
DOWN_STATUSES = frozenset({502, 503, 504})  # a server answering these is out of rotation, its request retried
_OUTCOME_OF_STATUS = {
    400: Outcome.BAD_REQUEST,
    408: Outcome.TIMEOUT,
    413: Outcome.TOO_LARGE,
    502: Outcome.UPSTREAM_FAILED,
    503: Outcome.NO_UPSTREAM,
}
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class UpstreamFailed(Exception):
    """An upstream call failed before its answer started (the request may go elsewhere)."""


class ProxyApp:
    """Built by PDProxy on its event loop; `handle` is aiohttp's request handler."""

    def __init__(
        self, config: ProxyConfig, metrics: ProxyMetrics, session: aiohttp.ClientSession, prefill: Pool, decode: Pool
    ) -> None:
        self.config, self.metrics, self.session = config, metrics, session
        self.prefill, self.decode = prefill, decode

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Never raises but for a client gone (its task is cancelled or its connection reset):
        every error is a JSON answer and an outcome counted."""
        try:
            response, outcome = await self._route(request)
        except ProxyError as exc:
            response = error_response(exc.status, exc.message, exc.param, retry_after_s=exc.retry_after_s)
            outcome = _OUTCOME_OF_STATUS[exc.status]
        except (asyncio.CancelledError, ConnectionError):
            self.metrics.count(Outcome.CLIENT_GONE)
            raise
        except Exception:
            log.exception("pd-proxy: %s %s failed in the proxy", request.method, request.path)
            response, outcome = error_response(500, "internal error of the proxy (logged)"), Outcome.INTERNAL_ERROR
        if outcome is not None:
            self.metrics.count(outcome)
        return response

    async def _route(self, request: web.BaseRequest) -> tuple[web.StreamResponse, Outcome | None]:
        if request.method == "GET" and request.path == "/metrics":
            return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}), None
        if request.method == "GET" and request.path == "/health":
            return self._health(), None
        raw = await read_body(request, self.config.max_body_nbytes, self.config.read_timeout_s)
        if request.method != "POST" or request.path not in PD_PATHS:
            return await self._decode(request, raw or None, {})
        body = completion_request(raw)
        params, prefilled = await self._prefill(request, body)
        payload = json.dumps(decode_body(body, params)).encode()
        return await self._decode(request, payload, {"X-LayerKV-Prefill": prefilled})

    def _health(self) -> web.Response:
        """200 while a decode server is in rotation (the proxy can answer), else 503 with Retry-After."""
        up = {pool.role.value: [u.url for u in pool.upstreams if u.in_rotation] for pool in (self.prefill, self.decode)}
        if up["decode"]:
            return web.json_response({"status": "ok", "in_rotation": up})
        body = {"status": "no decode server in rotation", "in_rotation": up}
        headers = {"Retry-After": retry_after(self.decode.seconds_until_return())}
        return web.json_response(body, status=503, headers=headers)

    async def _prefill(self, request: web.BaseRequest, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The prefill's kv_transfer_params (None if it gave none) and "ok", or None and "failed"."""
        upstream = self.prefill.pick()
        if upstream is None:
            return self._prefill_failed("none", "no prefill server in rotation")
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        try:
            with self.prefill.lease(upstream):
                async with self.session.post(
                    upstream.url + request.path, json=prefill_body(body), headers=_forwarded(request)
                ) as answer:
                    raw = await _read_answer(answer, self.config.max_body_nbytes)
        except UPSTREAM_ERRORS as exc:
            self._upstream_failed(self.prefill, upstream, _describe(exc))
            return self._prefill_failed(upstream.url, _describe(exc))
        self.metrics.upstream_latency.labels("prefill", upstream.url).observe(loop.time() - start_s)
        if answer.status in DOWN_STATUSES:
            self._upstream_failed(self.prefill, upstream, f"it answered {answer.status}")
        if answer.status != 200:
            return self._prefill_failed(upstream.url, f"it answered {answer.status}: {raw[:200]!r}")
        try:
            params = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError) as exc:
            return self._prefill_failed(upstream.url, f"its answer is not a JSON object ({exc})")
        self.metrics.prefills.labels("ok").inc()
        return (params if isinstance(params, dict) else None), "ok"

    def _prefill_failed(self, server: str, reason: str) -> tuple[None, str]:
        log.warning("pd-proxy: prefill on %s failed (%s); the decode server computes the prompt", server, reason)
        self.metrics.prefills.labels("failed").inc()
        self.metrics.prefill_failures.labels(server).inc()
        return None, "failed"

    async def _decode(
        self, request: web.BaseRequest, payload: bytes | None, extra: dict[str, str]
    ) -> tuple[web.StreamResponse, Outcome]:
        """The request to a decode server, retried once on another if the first failed before
        answering; ProxyError 503 with none in rotation, 502 if both tries failed."""
        tried: tuple[Upstream, ...] = ()
        reason = ""
        while len(tried) < 2 and (upstream := self.decode.pick(exclude=tried)) is not None:
            if tried:
                self.metrics.decode_retries.inc()
            tried += (upstream,)
            try:
                return await self._stream(request, upstream, payload, extra)
            except UpstreamFailed as exc:
                reason = f"{upstream.url}: {exc}"
                self._upstream_failed(self.decode, upstream, str(exc))
        if not tried:
            wait_s = self.decode.seconds_until_return()
            message = f"no decode server in rotation; the first may return in {wait_s:.1f} s"
            raise ProxyError(503, message, retry_after_s=wait_s)
        raise ProxyError(502, f"the decode server failed ({reason})")

    async def _stream(
        self, request: web.BaseRequest, upstream: Upstream, payload: bytes | None, extra: dict[str, str]
    ) -> tuple[web.StreamResponse, Outcome]:
        """`upstream`'s answer to the client chunk by chunk (a write waits while the client
        reads slowly: nothing piles up). UpstreamFailed before the answer started."""
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        headers = _forwarded(request)
        if payload is not None:
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        with self.decode.lease(upstream):
            try:
                answer = await self.session.request(
                    request.method, upstream.url + request.path_qs, data=payload, headers=headers
                )
            except UPSTREAM_ERRORS as exc:
                raise UpstreamFailed(_describe(exc)) from None
            async with answer:
                if answer.status in DOWN_STATUSES:
                    raise UpstreamFailed(f"it answered {answer.status}")
                content_type = answer.headers.get("Content-Type", "application/json")
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": content_type, **extra})
                await response.prepare(request)
                while True:
                    try:
                        chunk = await answer.content.readany()
                    except UPSTREAM_ERRORS as exc:  # after the answer started: no retry, cut the client's stream
                        self._upstream_failed(self.decode, upstream, f"its answer broke off: {_describe(exc)}")
                        if request.transport is not None:
                            request.transport.close()
                        return response, Outcome.STREAM_BROKEN
                    if not chunk:
                        break
                    await response.write(chunk)
        await response.write_eof()
        self.metrics.upstream_latency.labels("decode", upstream.url).observe(loop.time() - start_s)
        return response, Outcome.OK

    def _upstream_failed(self, pool: Pool, upstream: Upstream, reason: str) -> None:
        self.metrics.upstream_failures.labels(pool.role.value, upstream.url).inc()
        pool.failed(upstream, reason)


async def _read_answer(answer: aiohttp.ClientResponse, max_nbytes: int) -> bytes:
    """An upstream's whole answer, cut at `max_nbytes` (a prefill's answer is one token)."""
    chunks: list[bytes] = []
    nbytes = 0
    while nbytes <= max_nbytes and (chunk := await answer.content.readany()):
        chunks.append(chunk)
        nbytes += len(chunk)
    return b"".join(chunks)


def _forwarded(request: web.BaseRequest) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
