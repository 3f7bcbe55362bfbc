"""The proxy as the tests meet it: `layerkv pd-proxy` as a real child process (ProxyProcess: its
URL from the line it prints, its VmRSS from /proc, a bounded stop), fake upstreams in this process
(layerkv.bench.proxy.fake_vllm), and a client that speaks plain HTTP/1.1 over a socket, so a test
can send what no HTTP library would (a bad Content-Length, half a body, nothing at all)."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import layerkv
from layerkv.bench.vllm.engines import stop_group

START_TIMEOUT_S = 60.0  # the CLI imports aiohttp on a busy 2-core machine


class ProxyProcess:
    """`python -m layerkv.cli pd-proxy --port 0 ...` with its log in `log_path`."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], log_path: Path, **limits: float) -> None:
        argv = [sys.executable, "-m", "layerkv.cli", "pd-proxy", "--port", "0"]
        argv += [a for url in prefill_urls for a in ("--prefill", url)]
        argv += [a for url in decode_urls for a in ("--decode", url)]
        argv += [a for name, value in limits.items() for a in ("--" + name.replace("_", "-"), str(value))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(layerkv.__file__).parents[1]), *sys.path])}
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True
        )  # its own process group: stop_group ends it
        self.url = self._listening_url()

    def _listening_url(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().decode() if ready else ""
        if "listening on " not in line:
            self.stop()
            raise RuntimeError(f"pd-proxy did not start: {line!r}; log: {Path(self._log.name).read_text()[-2000:]}")
        return line.split("listening on ", 1)[1].split()[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def rss_nbytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        stop_group(self.proc, 15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    return sock


def request_bytes(path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    """A well-formed request (Content-Length from `body` unless `headers` names one)."""
    lines = [f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1", "Host: proxy", "Connection: close"]
    fields = {"Content-Type": "application/json", **({"Content-Length": str(len(body))} if body is not None else {})}
    fields.update(headers or {})
    lines += [f"{name}: {value}" for name, value in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def read_answer(sock: socket.socket) -> Answer:
    """One answer read to the connection's end (the requests say Connection: close), de-chunked."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    if not data:
        raise ConnectionError("the proxy closed the connection without an answer")
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Answer(int(status_line.split()[1]), headers, body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def call(port: int, raw: bytes, timeout_s: float = 30.0) -> Answer:
    with connect(port, timeout_s) as sock:
        sock.sendall(raw)
        return read_answer(sock)


def post_json(port: int, path: str, body: Any, timeout_s: float = 30.0) -> Answer:
    return call(port, request_bytes(path, json.dumps(body).encode()), timeout_s)


def completion(port: int, timeout_s: float = 30.0, **fields: Any) -> Answer:
    body = {"model": "fake", "prompt": "hello", "max_tokens": 3, **fields}
    return post_json(port, "/v1/completions", body, timeout_s)


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The proxy's /metrics, parsed by prometheus_client: {(sample name, sorted labels): value}."""
    text = call(port, request_bytes("/metrics")).body.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(port: int, name: str, **labels: str) -> float:
    return metrics(port).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_any(servers: list[Any], timeout_s: float) -> Any:
    """The first of `servers` (FakeServer) a completion arrived at, waiting at most `timeout_s`."""
    found: list[Any] = []
    done = threading.Event()
    for server in servers:
        threading.Thread(target=lambda s=server: s.wait_received(1, timeout_s) and (found.append(s), done.set()),
                         name=f"test-wait-{server.name}", daemon=True).start()  # fmt: skip
    assert done.wait(timeout_s), f"no request arrived at {[s.name for s in servers]}"
    return found[0]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Until `predicate()` holds (checked every 50 ms), at most `timeout_s`."""
    pause = threading.Event()
    deadline = _now() + timeout_s
    while not predicate():
        if _now() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        pause.wait(0.05)


def _now() -> float:
    import time

    return time.monotonic()
