"""What a client sends and what the upstreams get: the bounded read of a request body, the
checks of a completion request (an error the client gets names the field), the prefill and decode
bodies, and the one JSON error shape. Pure functions and one coroutine, run by a request's
handler task on the proxy's event loop.

Every error the proxy answers itself is OpenAI's shape (vLLM answers the same):
    {"error": {"message": "...", "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}}
"""

from __future__ import annotations

import asyncio
import json
import math
from http import HTTPStatus
from typing import Any

from aiohttp import web

# the fields a prefill server must not get: it answers one token, not streamed
# (min_tokens above its max_tokens 1 would be a 400 of the prefill server's)
_NOT_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "min_tokens")
_TYPES = {400: "BadRequestError", 408: "RequestTimeout", 413: "PayloadTooLarge", 502: "BadGateway"}


class ProxyError(Exception):
    """An answer the proxy gives itself: `status`, a message, the request field at fault, and
    for a 503 when to ask again (`retry_after_s`, sent as Retry-After)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, *, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": f"pd-proxy: {message}", "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, *, retry_after_s: float | None = None
) -> web.Response:
    """The JSON error; a 4xx that may leave a body unread closes the connection after it. With
    `retry_after_s`, a Retry-After header (whole seconds, at least 1: RFC 9110 §10.2.3)."""
    headers = None if retry_after_s is None else {"Retry-After": retry_after(retry_after_s)}
    response = web.json_response(error_body(status, message, param), status=status, headers=headers)
    if status in (408, 413):
        response.force_close()
    return response


def retry_after(seconds: float) -> str:
    """A Retry-After value: `seconds` rounded up to a whole second, at least 1."""
    return str(max(1, math.ceil(seconds)))


async def read_body(request: web.BaseRequest, max_nbytes: int, timeout_s: float) -> bytes:
    """The whole body, at most `max_nbytes` (ProxyError 413 the moment it is known to be more:
    from Content-Length before a byte is read, else as it arrives), within `timeout_s` (408)."""
    if request.content_length is not None and request.content_length > max_nbytes:
        raise ProxyError(413, f"Content-Length {request.content_length} is over the limit of {max_nbytes} bytes")
    chunks: list[bytes] = []
    nbytes = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                nbytes += len(chunk)
                if nbytes > max_nbytes:
                    raise ProxyError(413, f"the body is over the limit of {max_nbytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ProxyError(408, f"the body did not arrive within {timeout_s:g} s") from None
    except web.RequestPayloadError as exc:  # a malformed chunked body, a length the connection's end cut short
        raise ProxyError(400, f"the body could not be read: {exc}") from None
    return b"".join(chunks)


def completion_request(raw: bytes) -> dict[str, Any]:
    """The checked body of a completion or chat completion; ProxyError 400 naming the field.
    Checked: a JSON object; kv_transfer_params an object; stream a boolean; max_tokens and
    max_completion_tokens whole numbers >= 1 (null counts as absent). The rest is the decode
    server's to judge (its own 400 goes to the client)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"the body must be a JSON object, not {type(body).__name__}")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ProxyError(400, f"kv_transfer_params must be an object, not {_kind(params)}", "kv_transfer_params")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ProxyError(400, f"stream must be true or false, not {_kind(stream)}", "stream")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ProxyError(400, f"{name} must be a whole number >= 1, not {json.dumps(value)}", name)
    return body


def _kind(value: Any) -> str:
    return {str: "a string", list: "an array", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it: one token, no stream, asking for params."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(body.get("kv_transfer_params") or {}))
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The original request plus the prefill server's kv_transfer_params (if it gave any)."""
    return {**body, "kv_transfer_params": params} if params else dict(body)
