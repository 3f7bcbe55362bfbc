"""Prefill/decode through `layerkv pd-proxy` (layerkv.integrations.pd_proxy) in front of two `vllm
serve` servers on one `layerkv master`, started with the first prefill and the first decode command
line of docs/vllm.md's 2 x 2: a prefill server (kv_producer, TP=2) and a decode server
(kv_consumer, TP=1), both store_shards=2, with the `openai` client. The decode server loads the
prompt's full blocks from the pool right after the prefill server answered; a prefill server that
cannot be reached costs only the prefill (the decode server computes the prompt).

The decode server continues KV computed at TP=2, which differs from its own by the rounding of the
all-reduce, so its answer is compared with the prefill server's own (one server, the prompt from
its prefix cache): the same text, logprobs equal to rounding; the bit-exact checks of the sharing
are tests/vllm_engine/test_engine_tp_sharing.py and tests/e2e/test_tensor_parallel_sharing.py."""

from __future__ import annotations

import math
import time

import pytest

from layerkv.integrations.pd_proxy import PDProxy, ProxyConfig
from tests.vllm_engine.engine_proc import ServeProcess
from tests.vllm_engine.test_serve import layerkv_counters
from tests.vllm_engine.tier import BLOCK_SIZE, MODEL_NAME, MasterPorts
from tests.vllm_engine.tiny_model import prompt, words

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("serve-prefill", "serve-decode")]


def _complete(base_url: str, text: str, max_tokens: int = 4):  # type: ignore[no-untyped-def]
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    start = time.monotonic()
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=1
    )
    return raw.parse(), raw.headers, time.monotonic() - start


def _same_answer(a, b) -> None:  # type: ignore[no-untyped-def]
    """Same text; logprobs equal to the rounding of a TP=2 all-reduce against TP=1."""
    assert a.choices[0].text == b.choices[0].text
    got, want = a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs
    assert len(got) == len(want) and all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(got, want)), (
        got,
        want,
    )


def test_a_request_through_the_proxy_is_decoded_from_the_pool(fleet) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = fleet.get("serve-prefill"), fleet.get("serve-decode")
    assert isinstance(prefill, ServeProcess) and isinstance(decode, ServeProcess)
    proxy = PDProxy([prefill.base_url], [decode.base_url]).start()
    try:
        text = words(prompt(95, 5 * BLOCK_SIZE) + prompt(96, 10))  # 5 full blocks and 10 tokens
        before = layerkv_counters(decode)
        pd, headers, pd_s = _complete(proxy.url, text)
        after = layerkv_counters(decode)
        single, _, _ = _complete(prefill.base_url, text)  # one server: the prompt from its own prefix cache
    finally:
        proxy.close()
    assert headers.get("x-layerkv-prefill") == "ok" and proxy.prefills == {"ok": 1, "failed": 0}
    assert pd.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE  # the decode server's pool hit
    assert single.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE
    _same_answer(pd, single)
    hits = after.get("scheduler_hit_blocks", 0) - before.get("scheduler_hit_blocks", 0)
    waits = after.get("scheduler_prefill_waits", 0) - before.get("scheduler_prefill_waits", 0)
    assert hits >= 5, (before, after)
    print(
        f"P/D through the proxy: {pd_s * 1000:.0f} ms, decode pool hit blocks {hits:.0f}, decode waits for the "
        f"prefill's commit {waits:.0f} "
        f"({after.get('scheduler_prefill_wait_ms', 0) - before.get('scheduler_prefill_wait_ms', 0):.0f} ms)"
    )


def test_without_its_prefill_server_the_proxy_still_answers(fleet) -> None:  # type: ignore[no-untyped-def]
    decode = fleet.get("serve-decode")
    nowhere = f"http://127.0.0.1:{MasterPorts.pick().rpc_port}"  # a free port: nobody listens
    proxy = PDProxy([nowhere], [decode.base_url], ProxyConfig(upstream_timeout_s=30)).start()
    try:
        text = words(prompt(97, 3 * BLOCK_SIZE))
        got, headers, _ = _complete(proxy.url, text)
        alone, _, _ = _complete(decode.base_url, text)
    finally:
        proxy.close()
    assert headers.get("x-layerkv-prefill") == "failed" and proxy.prefills == {"ok": 0, "failed": 1}
    assert not (got.usage.prompt_tokens_details and got.usage.prompt_tokens_details.cached_tokens)  # computed whole
    assert got.choices[0].text == alone.choices[0].text
