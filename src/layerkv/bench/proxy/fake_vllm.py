"""Fake vLLM servers for the proxy's bench and tests: `/v1/completions` and
`/v1/chat/completions` (a prefill server answers one token and kv_transfer_params naming it; a
decode server answers `max_tokens` tokens, streamed as server-sent events if asked, and says
which kv_transfer_params it got), `/health` and `/v1/models`, after a fixed service time. A
server's `mode` makes it fail (503, /health too), hang, or break its answer off mid-stream.
`FakeFleet` runs several on one event loop in a daemon thread (layerkv-fake-vllm); the test or
bench thread sets modes (a plain assignment) and reads `received` (appended under a condition).
`python -m layerkv.bench.proxy.fake_vllm` runs a fleet in its own process (the bench's)."""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

HANG_S = 3600.0  # a hanging server's answer: past every timeout a test or the proxy sets


class Mode(str, enum.Enum):
    OK = "ok"
    FAIL = "fail"  # 503 to everything, /health included: a server shutting down or overloaded
    HANG = "hang"  # completions never answer (/health still 200): a wedged engine
    BREAK = "break"  # a decode answer breaks off after its first chunk: a server dying mid-stream


@dataclass(eq=False)
class FakeServer:
    name: str
    role: str  # "prefill" or "decode"
    service_s: float = 0.0
    mode: Mode = Mode.OK
    received: list[dict[str, Any]] = field(default_factory=list)  # the completion bodies, in order
    url: str = ""
    _arrived: threading.Condition = field(default_factory=threading.Condition)  # guards received

    def wait_received(self, num_requests: int, timeout_s: float) -> bool:
        """True once `num_requests` completions have arrived here (any thread), False at the timeout."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self.received) >= num_requests, timeout_s)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        with self._arrived:
            self.received.append(body)
            self._arrived.notify_all()
        if self.mode is Mode.FAIL:
            return web.json_response({"error": {"message": f"{self.name} fails", "code": 503}}, status=503)
        if self.mode is Mode.HANG:
            await asyncio.sleep(HANG_S)
        if self.service_s:
            await asyncio.sleep(self.service_s)
        if self.role == "prefill":
            params = {"prefilled_by": self.name, "client_params": body.get("kv_transfer_params")}
            return web.json_response({"choices": [{"index": 0, "text": " a"}], "kv_transfer_params": params})
        num_tokens = int(body.get("max_tokens") or 4)
        if body.get("stream"):
            return await self._stream(request, num_tokens)
        answer = {"choices": [{"index": 0, "text": " t" * num_tokens}], "server": self.name}
        answer["kv_transfer_params_received"] = body.get("kv_transfer_params")
        if self.mode is Mode.BREAK:
            return await self._broken(request, json.dumps(answer).encode())
        return web.json_response(answer)

    async def _stream(self, request: web.Request, num_tokens: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(num_tokens):
            event = {"choices": [{"index": 0, "text": f" t{i}"}], "server": self.name}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.mode is Mode.BREAK:
                assert request.transport is not None
                request.transport.abort()
                return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _broken(self, request: web.Request, payload: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(payload)
        await response.prepare(request)
        await response.write(payload[: len(payload) // 2])
        assert request.transport is not None
        request.transport.abort()
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode is Mode.FAIL else 200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "owned_by": self.name}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app


class FakeFleet:
    """Fake servers on one event loop in a daemon thread: start() returns once all listen."""

    def __init__(self, servers: list[FakeServer], host: str = "127.0.0.1") -> None:
        self.servers = {s.name: s for s in servers}
        self._host = host
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="layerkv-fake-vllm", daemon=True)

    def __getitem__(self, name: str) -> FakeServer:
        return self.servers[name]

    def start(self, timeout_s: float = 30.0) -> FakeFleet:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"fake vLLM servers did not start within {timeout_s} s")
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runners = []
        try:
            for server in self.servers.values():
                runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=1.0)
                await runner.setup()
                runners.append(runner)
                await web.TCPSite(runner, self._host, 0).start()
                server.url = f"http://{self._host}:{runner.addresses[0][1]}"
            self._ready.set()
            await self._stop.wait()
        finally:
            for runner in runners:
                await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """A fleet in this process: prints {"prefill": [urls], "decode": [urls]} on stdout, runs until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", type=int, default=1, help="how many prefill servers")
    parser.add_argument("--decode", type=int, default=1, help="how many decode servers")
    parser.add_argument("--service-ms", type=float, default=0.0, help="each answer's service time")
    args = parser.parse_args(argv)
    servers = [FakeServer(f"prefill-{i}", "prefill", args.service_ms / 1000) for i in range(args.prefill)]
    servers += [FakeServer(f"decode-{i}", "decode", args.service_ms / 1000) for i in range(args.decode)]
    fleet = FakeFleet(servers).start()
    urls = {role: [s.url for s in servers if s.role == role] for role in ("prefill", "decode")}
    print(json.dumps(urls), flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies) to stop us
    fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
