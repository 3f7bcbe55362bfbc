"""A prefill/decode proxy for two OpenAI-compatible vLLM servers with layerkv (standard library
HTTP only). Each completion or chat completion goes first to the prefill server (kv_producer)
with max_tokens 1 and no streaming; the `kv_transfer_params` of its answer (the prefix it
commits to the pool, connector/prefill_wait.py) go with the original request to the decode
server (kv_consumer), whose answer (streamed or not) is the client's. If the prefill server
fails, the decode server gets the request alone and computes the whole prompt (the answer is
the same, only slower); `X-LayerKV-Prefill` in the response says which happened.
Everything else (`/v1/models`, `/health`, ...) goes to the decode server. One thread per client
connection (ThreadingHTTPServer); every upstream call is bounded by `timeout_s`.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
CHUNK = 64 * 1024


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it: one token, no stream, asking for params."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(body.get("kv_transfer_params") or {}))
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The original request plus the prefill server's kv_transfer_params (if it gave any)."""
    return {**body, "kv_transfer_params": params} if params else dict(body)


class PDProxy:
    """Listens on `host:port` (0: a free port; `port` holds it after start)."""

    def __init__(
        self, prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0
    ) -> None:
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.timeout_s = timeout_s
        self.prefills = {"ok": 0, "failed": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: each answer ends when its connection closes
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                proxy._post(self)

            def do_GET(self) -> None:  # noqa: N802
                proxy._forward(self, "GET", None)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("pd-proxy: " + fmt, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> PDProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    # -- handlers --------------------------------------------------------------------------
    def _post(self, handler: BaseHTTPRequestHandler) -> None:
        raw = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if handler.path not in PD_PATHS:
            self._forward(handler, "POST", raw)
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            self._reply(handler, 400, json.dumps({"error": f"pd-proxy: bad request body: {exc}"}).encode())
            return
        params, outcome = self._prefill(handler.path, body)
        self._forward(handler, "POST", json.dumps(decode_body(body, params)).encode(), {"X-LayerKV-Prefill": outcome})

    def _prefill(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        request = urllib.request.Request(
            self.prefill_url + path,
            json.dumps(prefill_body(body)).encode(),
            {"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                params = json.loads(answer.read()).get("kv_transfer_params")
        except (OSError, ValueError, AttributeError) as exc:  # URLError and HTTPError are OSErrors
            self.prefills["failed"] += 1
            log.warning(
                "pd-proxy: prefill server %s failed (%s); the decode server computes the prompt", self.prefill_url, exc
            )
            return None, "failed"
        self.prefills["ok"] += 1
        return (params if isinstance(params, dict) else None), "ok"

    def _forward(
        self, handler: BaseHTTPRequestHandler, method: str, raw: bytes | None, extra: dict[str, str] | None = None
    ) -> None:
        """`handler`'s request to the decode server; its answer back as it comes (the
        connection's close ends it)."""
        request = urllib.request.Request(
            self.decode_url + handler.path,
            raw,
            method=method,
            headers={"Content-Type": handler.headers.get("Content-Type", "application/json")},
        )
        try:
            answer = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            answer = exc  # the decode server's own error reply
        except OSError as exc:
            self._reply(
                handler, 502, json.dumps({"error": f"pd-proxy: decode server {self.decode_url}: {exc}"}).encode()
            )
            return
        with answer:
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
            for name, value in (extra or {}).items():
                handler.send_header(name, value)
            handler.end_headers()
            while chunk := answer.read1(CHUNK):  # a stream's events as they come
                handler.wfile.write(chunk)
                handler.wfile.flush()

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
