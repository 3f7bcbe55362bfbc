"""Malformed and hostile requests against `layerkv pd-proxy` running as its own process (this
test process is the attacker, on raw sockets): each gets a JSON error with its status, or its
connection closed, within a bound set by the limit it hits; the proxy answers a normal request
after each; its memory stays bounded whatever length a client announces or sends."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layerkv.bench.proxy.fake_vllm import FakeFleet
from tests.pd_proxy import rig
from tests.pd_proxy.conftest import urls

READ_TIMEOUT_S = 0.5
IDLE_TIMEOUT_S = 2.0  # the normal requests of these tests send at once after connecting: far below it
MAX_BODY_NBYTES = 1 << 20
MARGIN = 10  # a bound is the limit it guards times this (a busy 2-core machine), never a measured time
RSS_GROWTH_NBYTES = 48 << 20  # generous next to the 1 MiB body limit; far below what was announced or sent


@pytest.fixture(scope="module")
def proxy(_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[rig.ProxyProcess]:
    log_path = tmp_path_factory.mktemp("pd-proxy") / "proxy.log"
    limits = dict(read_timeout_s=READ_TIMEOUT_S, idle_timeout_s=IDLE_TIMEOUT_S, max_body_nbytes=MAX_BODY_NBYTES)
    process = rig.ProxyProcess(urls(_fleet, "prefill"), urls(_fleet, "decode"), log_path, **limits)
    yield process
    process.stop()


def _error(answer: rig.Answer, status: int, param: str | None = None) -> str:
    """The error's message, after checking its status, content type and shape."""
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"].startswith("pd-proxy: ")
    return str(error["message"])


def _still_answers(proxy: rig.ProxyProcess) -> None:
    answer = rig.completion(proxy.port)
    assert answer.status == 200 and answer.headers["x-layerkv-prefill"] == "ok", answer


@pytest.mark.parametrize(
    "params, kind", [("text", "a string"), ([1, 2], "an array"), (7, "a number"), (True, "a boolean")]
)
def test_kv_transfer_params_not_an_object_is_a_400_naming_it(
    fleet: FakeFleet, proxy: rig.ProxyProcess, params: Any, kind: str
) -> None:
    message = _error(rig.completion(proxy.port, kv_transfer_params=params), 400, "kv_transfer_params")
    assert f"kv_transfer_params must be an object, not {kind}" in message
    assert not fleet["decode-0"].received and not fleet["prefill-0"].received  # nothing went upstream
    _still_answers(proxy)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b"{not json", None, "the body is not JSON"),
        (b"\xff\xfe", None, "the body is not JSON"),
        (b"[1, 2]", None, "must be a JSON object, not list"),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "stream must be true or false"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "max_tokens must be a whole number >= 1"),
        (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens", "max_tokens must be a whole number >= 1"),
        (b'{"messages": [], "max_completion_tokens": 1.5}', "max_completion_tokens", "whole number >= 1"),
    ],
)
def test_a_bad_body_is_a_400(
    fleet: FakeFleet, proxy: rig.ProxyProcess, body: bytes, param: str | None, words: str
) -> None:
    assert words in _error(rig.call(proxy.port, rig.request_bytes("/v1/completions", body)), 400, param)
    _still_answers(proxy)


@pytest.mark.parametrize("length", ["abc", "-1", "+5", "1 2", "0x10"])
def test_a_bad_content_length_is_a_400(fleet: FakeFleet, proxy: rig.ProxyProcess, length: str) -> None:
    """aiohttp's parser refuses them; the proxy's answer is JSON all the same, and never a hang:
    the socket's timeout bounds the wait on the answer."""
    raw = rig.request_bytes("/v1/completions", b"{}", {"Content-Length": length})
    assert "Content-Length" in _error(rig.call(proxy.port, raw, timeout_s=READ_TIMEOUT_S * MARGIN), 400)
    _still_answers(proxy)


def test_ten_gigabytes_announced_is_a_413_before_a_byte_is_read(fleet: FakeFleet, proxy: rig.ProxyProcess) -> None:
    before = proxy.rss_nbytes()
    raw = rig.request_bytes("/v1/completions", b'{"prompt": ', {"Content-Length": str(10 << 30)})
    message = _error(rig.call(proxy.port, raw, timeout_s=READ_TIMEOUT_S * MARGIN), 413)
    assert f"Content-Length {10 << 30} is over the limit of {MAX_BODY_NBYTES} bytes" in message
    assert proxy.rss_nbytes() - before < RSS_GROWTH_NBYTES
    _still_answers(proxy)


def test_a_chunked_body_past_the_limit_is_a_413_and_what_follows_is_dropped(
    fleet: FakeFleet, proxy: rig.ProxyProcess
) -> None:
    """64 MiB sent as chunks without a Content-Length: the proxy reads up to its limit, answers
    413, reads and drops the rest for a while and closes; its memory does not grow by what came."""
    before = proxy.rss_nbytes()
    head = rig.request_bytes("/v1/completions", None).replace(b"GET", b"POST").rstrip(b"\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
    with rig.connect(proxy.port, timeout_s=READ_TIMEOUT_S * MARGIN) as sock:
        sock.sendall(head + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        sender = threading.Thread(target=_send_quietly, args=(sock, [chunk] * 64), name="test-chunked-sender")
        sender.start()
        answer = rig.read_answer(sock)
        sender.join(READ_TIMEOUT_S * MARGIN)
    assert not sender.is_alive()
    assert f"the body is over the limit of {MAX_BODY_NBYTES} bytes" in _error(answer, 413)
    assert proxy.rss_nbytes() - before < RSS_GROWTH_NBYTES
    _still_answers(proxy)


def _send_quietly(sock: socket.socket, chunks: list[bytes]) -> None:
    try:
        for chunk in chunks:
            sock.sendall(chunk)
    except OSError:  # the proxy closed after its 413: what it refused need not arrive
        pass


def test_a_body_that_stalls_is_a_408_then_the_connection_closes(fleet: FakeFleet, proxy: rig.ProxyProcess) -> None:
    raw = rig.request_bytes("/v1/completions", b'{"prompt": "x"}', {"Content-Length": "100"})
    with rig.connect(proxy.port, timeout_s=(READ_TIMEOUT_S + 2) * MARGIN) as sock:  # + aiohttp's lingering close
        sock.sendall(raw)  # 15 bytes of the 100 announced, then nothing
        answer = rig.read_answer(sock)  # to the connection's end: the proxy closes it
    assert f"did not arrive within {READ_TIMEOUT_S:g} s" in _error(answer, 408)
    assert not fleet["prefill-0"].received and not fleet["decode-0"].received
    _still_answers(proxy)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Le"])
def test_a_connection_without_a_whole_head_is_closed(fleet: FakeFleet, proxy: rig.ProxyProcess, sent: bytes) -> None:
    """Nothing at all, or half a head: closed once idle_timeout_s has passed (aiohttp's keep-alive
    timer runs until a head is complete), no answer: there is no request to answer."""
    with rig.connect(proxy.port, timeout_s=IDLE_TIMEOUT_S * MARGIN) as sock:
        sock.sendall(sent)
        assert sock.recv(1024) == b""  # the proxy's close, not the socket's timeout (that raises)
    _still_answers(proxy)


def test_each_outcome_is_counted(fleet: FakeFleet, proxy: rig.ProxyProcess) -> None:
    before = rig.metrics(proxy.port)
    rig.completion(proxy.port, stream=1)
    rig.call(proxy.port, rig.request_bytes("/v1/completions", b"{}", {"Content-Length": "x"}))
    rig.call(proxy.port, rig.request_bytes("/v1/completions", b"{}", {"Content-Length": str(MAX_BODY_NBYTES + 1)}))
    _still_answers(proxy)
    after = rig.metrics(proxy.port)
    grown = {
        labels[0][1]: after[(name, labels)] - before.get((name, labels), 0.0)
        for name, labels in after
        if name == "layerkv_pd_proxy_requests_total"
    }
    assert {k: v for k, v in grown.items() if v} == {"bad_request": 2, "too_large": 1, "ok": 1}, json.dumps(grown)


def test_the_limits_are_checked_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pd-proxy did not start") as info:
        rig.ProxyProcess(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], tmp_path / "log", read_timeout_s=0)
    assert "read_timeout_s=0.0 must be a number of seconds > 0" in (tmp_path / "log").read_text()
    assert info.value is not None


@pytest.mark.parametrize("missing", ["aiohttp", "prometheus_client"])
def test_without_its_dependencies_it_says_what_to_install(missing: str) -> None:
    """On a host without vLLM (so without aiohttp or prometheus_client): a message and exit 2, no traceback."""
    code = f"import sys; sys.modules[{missing!r}] = None; from layerkv.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]
    done = subprocess.run([sys.executable, "-c", code, "pd-proxy", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"({missing} is not installed)" in done.stderr and "pip install 'layerkv[proxy]'" in done.stderr
    assert "Traceback" not in done.stderr
