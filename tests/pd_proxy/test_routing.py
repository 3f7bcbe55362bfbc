"""Routing over two prefill and two decode servers (fake upstreams) through PDProxy in this
process: least outstanding requests, the prefill's kv_transfer_params to whichever decode server
answers, a failed prefill costing only the prefill, a failed decode retried once on the other
server before anything streamed and never after, back-off and the /health probe that returns a
server, and the metrics of each, scraped from /metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from layerkv.bench.proxy.fake_vllm import FakeFleet, Mode
from layerkv.integrations.pd_proxy import PDProxy, ProxyConfig
from tests.pd_proxy import rig
from tests.pd_proxy.conftest import urls

WAIT_S = 30.0
BACKOFF_S = 0.2
PROBE_INTERVAL_S = 0.1


@pytest.fixture
def proxy(fleet: FakeFleet) -> Iterator[PDProxy]:
    config = ProxyConfig(backoff_s=BACKOFF_S, max_backoff_s=BACKOFF_S, probe_interval_s=PROBE_INTERVAL_S,
                         upstream_timeout_s=5.0)  # fmt: skip
    proxy = PDProxy(urls(fleet, "prefill"), urls(fleet, "decode"), config).start()
    yield proxy
    proxy.close()


def _out_of_rotation(proxy: PDProxy, role: str) -> float:
    return rig.sample(proxy.port, "layerkv_pd_proxy_servers_out_of_rotation", role=role)


def test_the_prefills_params_reach_whichever_decode_server_answers(fleet: FakeFleet, proxy: PDProxy) -> None:
    answers = [rig.completion(proxy.port, kv_transfer_params={"client": i}) for i in range(4)]
    assert all(a.status == 200 and a.headers["x-layerkv-prefill"] == "ok" for a in answers)
    for server in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert len(fleet[server].received) == 2, server  # idle servers: ties taken in turn
    for answer in answers:
        got = answer.json()["kv_transfer_params_received"]
        assert got["prefilled_by"] in ("prefill-0", "prefill-1")
    for server in ("decode-0", "decode-1"):  # each decode body carries the params its prefill returned
        for body in fleet[server].received:
            assert body["kv_transfer_params"]["client_params"]["client"] in range(4)
    prefill_bodies = fleet["prefill-0"].received + fleet["prefill-1"].received
    assert all(b["max_tokens"] == 1 and b["stream"] is False for b in prefill_bodies)
    assert proxy.prefills == {"ok": 4, "failed": 0}


def test_a_busy_server_is_passed_over_for_the_least_loaded(fleet: FakeFleet, proxy: PDProxy) -> None:
    """One request hangs on a decode server: the next five all go to the other one (in turn
    alone, every second one would go to the busy server)."""
    fleet["decode-0"].mode = fleet["decode-1"].mode = Mode.HANG
    stuck = threading.Thread(target=_quietly, args=(proxy,), name="test-stuck-client")
    stuck.start()
    busy = rig.wait_for_any([fleet["decode-0"], fleet["decode-1"]], WAIT_S)
    idle = fleet["decode-1" if busy.name == "decode-0" else "decode-0"]
    idle.mode = Mode.OK
    for _ in range(5):
        assert rig.completion(proxy.port).json()["server"] == idle.name
    assert len(busy.received) == 1
    proxy.close()  # ends the stuck request
    stuck.join(WAIT_S)
    assert not stuck.is_alive()


def _quietly(proxy: PDProxy) -> None:
    try:
        rig.completion(proxy.port, timeout_s=WAIT_S)
    except OSError:
        pass


def test_a_failed_prefill_costs_only_the_prefill(fleet: FakeFleet, proxy: PDProxy) -> None:
    fleet["prefill-0"].mode = Mode.FAIL
    first, second = rig.completion(proxy.port), rig.completion(proxy.port)
    assert first.status == 200 and first.headers["x-layerkv-prefill"] == "failed"
    assert first.json()["kv_transfer_params_received"] is None  # the decode server computed the prompt
    assert second.headers["x-layerkv-prefill"] == "ok"  # prefill-0 is out of rotation: prefill-1
    assert second.json()["kv_transfer_params_received"]["prefilled_by"] == "prefill-1"
    url = fleet["prefill-0"].url
    assert rig.sample(proxy.port, "layerkv_pd_proxy_prefill_failures_total", server=url) == 1
    assert proxy.prefills == {"ok": 1, "failed": 1}
    assert _out_of_rotation(proxy, "prefill") == 1
    fleet["prefill-0"].mode = Mode.OK  # its /health answers 200 again: the prober returns it
    rig.wait_for(lambda: _out_of_rotation(proxy, "prefill") == 0, WAIT_S, "prefill-0 back in rotation")


def test_without_any_prefill_server_the_decode_server_answers(fleet: FakeFleet) -> None:
    nowhere = "http://127.0.0.1:9"  # the discard port: nobody listens in the test's namespace
    proxy = PDProxy([nowhere], urls(fleet, "decode"), ProxyConfig(backoff_s=30, max_backoff_s=30)).start()
    try:
        answers = [rig.completion(proxy.port) for _ in range(2)]
        assert [a.headers["x-layerkv-prefill"] for a in answers] == ["failed", "failed"]
        assert all(a.status == 200 for a in answers)
        assert rig.sample(proxy.port, "layerkv_pd_proxy_prefill_failures_total", server=nowhere) == 1
        assert rig.sample(proxy.port, "layerkv_pd_proxy_prefill_failures_total", server="none") == 1  # out
    finally:
        proxy.close()


def test_a_decode_server_that_fails_before_answering_is_retried_once_on_another(
    fleet: FakeFleet, proxy: PDProxy
) -> None:
    fleet["decode-0"].mode = Mode.FAIL
    answers = [rig.completion(proxy.port, stream=True) for _ in range(3)]
    assert all(a.status == 200 and a.body.endswith(b"data: [DONE]\n\n") for a in answers)
    assert all(b'"server": "decode-1"' in a.body for a in answers)
    assert len(fleet["decode-0"].received) == 1  # tried once, then out of rotation
    assert rig.sample(proxy.port, "layerkv_pd_proxy_decode_retries_total") == 1
    assert _out_of_rotation(proxy, "decode") == 1
    assert rig.sample(proxy.port, "layerkv_pd_proxy_requests_total", outcome="ok") == 3


def test_a_hanging_decode_server_times_out_and_the_other_answers(fleet: FakeFleet) -> None:
    fleet["decode-0"].mode = Mode.HANG
    # the hanging call is given up after this; the prefill and decode-1 calls must fit in it too
    # (5 ms of service each), with room for a busy machine
    config = ProxyConfig(upstream_timeout_s=3.0, backoff_s=30, max_backoff_s=30)
    proxy = PDProxy(urls(fleet, "prefill"), urls(fleet, "decode"), config).start()
    try:
        answer = rig.completion(proxy.port)
        assert answer.status == 200 and answer.json()["server"] == "decode-1"
        assert rig.sample(proxy.port, "layerkv_pd_proxy_decode_retries_total") == 1
    finally:
        proxy.close()


def test_with_every_decode_server_failing_a_502_then_503_until_one_returns(fleet: FakeFleet, proxy: PDProxy) -> None:
    fleet["decode-0"].mode = fleet["decode-1"].mode = Mode.FAIL
    failed = rig.completion(proxy.port)
    assert failed.status == 502 and "the decode server failed" in failed.json()["error"]["message"]
    assert rig.call(proxy.port, rig.request_bytes("/health")).status == 503
    refused = rig.completion(proxy.port)
    if refused.status == 503:  # (the prober may have returned one already: then it failed again, a 502)
        assert "no decode server in rotation" in refused.json()["error"]["message"]
    else:
        assert refused.status == 502
    fleet["decode-0"].mode = fleet["decode-1"].mode = Mode.OK
    rig.wait_for(lambda: _out_of_rotation(proxy, "decode") == 0, WAIT_S, "both decode servers back")
    assert rig.completion(proxy.port).status == 200
    assert rig.sample(proxy.port, "layerkv_pd_proxy_requests_total", outcome="upstream_failed") >= 1


def test_a_503_says_when_to_ask_again(fleet: FakeFleet) -> None:
    """With every decode server out of rotation, the proxy's 503 (a completion's and /health's)
    carries Retry-After: whole seconds until the first may be probed back."""
    fleet["decode-0"].mode = fleet["decode-1"].mode = Mode.FAIL
    config = ProxyConfig(backoff_s=30.0, max_backoff_s=30.0, probe_interval_s=PROBE_INTERVAL_S)  # none returns here
    proxy = PDProxy(urls(fleet, "prefill"), urls(fleet, "decode"), config).start()
    try:
        assert rig.completion(proxy.port).status == 502  # both tried, both out of rotation
        refused, health = rig.completion(proxy.port), rig.call(proxy.port, rig.request_bytes("/health"))
        assert refused.status == health.status == 503, refused.body
        for answer in (refused, health):  # ~30 s of back-off left, then one probe interval
            assert 20 <= int(answer.headers["retry-after"]) <= 31, answer.headers
        assert "no decode server in rotation" in refused.json()["error"]["message"]
    finally:
        proxy.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_answer_that_breaks_off_is_cut_never_retried(fleet: FakeFleet, proxy: PDProxy, stream: bool) -> None:
    fleet["decode-0"].mode = Mode.BREAK
    with rig.connect(proxy.port, WAIT_S) as sock:
        body = {"model": "fake", "prompt": "x", "max_tokens": 3, "stream": stream}
        sock.sendall(rig.request_bytes("/v1/completions", json.dumps(body).encode()))
        data = b""
        while chunk := _recv_or_reset(sock):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and not data.endswith(b"0\r\n\r\n")  # no last chunk: cut
    assert not fleet["decode-1"].received  # never retried once the answer started
    assert rig.sample(proxy.port, "layerkv_pd_proxy_requests_total", outcome="stream_broken") == 1
    latency = rig.metrics(proxy.port)
    key = ("layerkv_pd_proxy_upstream_latency_seconds_count", (("role", "prefill"), ("server", fleet["prefill-0"].url)))
    assert latency[key] == 1


def _recv_or_reset(sock) -> bytes:  # type: ignore[no-untyped-def]
    try:
        return bytes(sock.recv(65536))
    except ConnectionResetError:
        return b""


def test_the_upstream_latency_histogram_has_each_server_and_role(fleet: FakeFleet, proxy: PDProxy) -> None:
    for _ in range(4):
        assert rig.completion(proxy.port).status == 200
    samples = rig.metrics(proxy.port)
    for role in ("prefill", "decode"):
        for server in (fleet[f"{role}-0"], fleet[f"{role}-1"]):
            key = ("layerkv_pd_proxy_upstream_latency_seconds_count", (("role", role), ("server", server.url)))
            assert samples[key] == 2, key
    assert samples[("layerkv_pd_proxy_servers_out_of_rotation", (("role", "decode"),))] == 0
