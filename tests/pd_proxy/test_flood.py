"""A flood of 1,000 idle connections against `layerkv pd-proxy` as its own process: it holds at
most `max_connections` (the rest are closed at accept, counted), stays within a bounded memory,
and answers a normal request once the flood is gone. The attacker is this test process. (The
connections it holds close once idle past idle_timeout_s: test_malformed.py; here that timeout
is far beyond the flood, so that what was held is what was accepted.)"""

from __future__ import annotations

import resource
import selectors
import socket
import time
from pathlib import Path

from layerkv.bench.proxy.fake_vllm import FakeFleet
from tests.pd_proxy import rig
from tests.pd_proxy.conftest import urls

NUM_CONNECTIONS = 1000
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 120.0  # never reached: the flood is released by this test
WAIT_S = 60.0
RSS_GROWTH_NBYTES = 48 << 20  # the old proxy's 1,000 threads: 8 MiB of stack reserved each, ~100 KiB resident each


def test_a_flood_of_idle_connections_is_bounded(fleet: FakeFleet, tmp_path: Path) -> None:
    _open_files_for(NUM_CONNECTIONS + 100)
    limits = dict(max_connections=MAX_CONNECTIONS, idle_timeout_s=IDLE_TIMEOUT_S)
    proxy = rig.ProxyProcess(urls(fleet, "prefill"), urls(fleet, "decode"), tmp_path / "proxy.log", **limits)
    socks: list[socket.socket] = []
    try:
        assert rig.completion(proxy.port).status == 200  # warm: the first request's imports are not the flood's
        before = proxy.rss_nbytes()
        socks = [rig.connect(proxy.port, timeout_s=WAIT_S) for _ in range(NUM_CONNECTIONS)]
        assert _wait_closed(socks, NUM_CONNECTIONS - MAX_CONNECTIONS, WAIT_S) == NUM_CONNECTIONS - MAX_CONNECTIONS
        grown_nbytes = proxy.rss_nbytes() - before
        for sock in socks:  # the flood ends: the proxy sees its 64 connections close
            sock.close()
        rig.wait_for(lambda: _answers(proxy), WAIT_S, "the proxy answers once the flood is gone")
        assert rig.sample(proxy.port, "layerkv_pd_proxy_connections_refused_total") >= NUM_CONNECTIONS - MAX_CONNECTIONS
        assert grown_nbytes < RSS_GROWTH_NBYTES, grown_nbytes
        answer = rig.completion(proxy.port)
        assert answer.status == 200 and answer.headers["x-layerkv-prefill"] == "ok"
    finally:
        for sock in socks:
            sock.close()
        proxy.stop()


def _answers(proxy: rig.ProxyProcess) -> bool:
    try:
        return rig.call(proxy.port, rig.request_bytes("/health"), timeout_s=WAIT_S).status == 200
    except ConnectionError:  # still refused: the proxy has not yet seen all of the flood close
        return False


def _wait_closed(socks: list[socket.socket], num_closed: int, timeout_s: float) -> int:
    """Waits until the far end closed (EOF or reset) `num_closed` of `socks`, at most `timeout_s`;
    how many it closed."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout_s
    try:
        while closed < num_closed and (left_s := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left_s):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1024)
                except ConnectionResetError:
                    data = b""
                assert data == b"", data  # an idle connection is never answered, only closed
                selector.unregister(sock)
                closed += 1
    finally:
        selector.close()
    return closed


def _open_files_for(num_files: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < num_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(num_files, hard), hard))
