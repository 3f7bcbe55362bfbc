"""`vllm serve` with layerkv, started with the README's "Use with vLLM" command (model name aside;
CPU and test flags appended), two servers on one `layerkv master`, and a real HTTP client (the
`openai` package): completions that share a prefix; the second server answers from the pool
exactly what the first answers from its own prefix cache; `/metrics` carries layerkv's counters,
its histograms and gauges under the `tenant` label, and the pool's hits as vLLM's `p2p` source.
"""

from __future__ import annotations

import re

import pytest

from layerkv.bench.load.probe import layerkv_counters as counters_of
from tests.vllm_engine.engine_proc import ServeProcess
from tests.vllm_engine.tier import BLOCK_SIZE, MODEL_NAME, readme_serve_argv
from tests.vllm_engine.tiny_model import prompt, words

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("serve-producer", "serve-consumer")]


@pytest.fixture(scope="module")
def servers(fleet):
    return fleet.get("serve-producer"), fleet.get("serve-consumer")


def complete(server: ServeProcess, text: str, max_tokens: int = 4):
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    return client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=1)


def layerkv_counters(server: ServeProcess) -> dict[str, float]:
    return counters_of(server.metrics())


def test_readme_command_names_the_layerkv_connector():
    argv = readme_serve_argv()
    assert argv[2] == "meta-llama/Llama-3.1-8B-Instruct"  # the one thing the test replaces
    assert '"kv_connector": "LayerKVConnector"' in argv[argv.index("--kv-transfer-config") + 1]


def test_two_servers_share_a_prefix_through_the_pool(servers):
    producer, consumer = servers
    prefix = prompt(90, 5 * BLOCK_SIZE)
    request = words(prefix + prompt(91, 10))
    first = complete(producer, words(prefix))  # computes and saves the 5 prefix blocks
    assert first.usage.prompt_tokens == 5 * BLOCK_SIZE

    local = complete(producer, request)  # from the producer's own prefix cache
    pooled = complete(consumer, request)  # a fresh server: from the pool

    assert pooled.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE
    assert local.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE
    assert pooled.choices[0].text == local.choices[0].text
    assert pooled.choices[0].logprobs.token_logprobs == local.choices[0].logprobs.token_logprobs

    loaded, saved = layerkv_counters(consumer), layerkv_counters(producer)
    assert loaded.get("load_blocks", 0) >= 5 and loaded.get("loaded_bytes", 0) > 0
    assert loaded.get("scheduler_hit_blocks", 0) >= 5
    assert saved.get("committed_keys", 0) >= 5 and saved.get("saved_bytes", 0) > 0


def scrape(server: ServeProcess) -> str:
    import httpx

    return httpx.get(f"{server.base_url}/metrics", timeout=10).text


def samples_of(text: str, family: str) -> dict[str, float]:
    """`family`'s sample lines in a /metrics text: {'name{labels}': value}."""
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf"^({re.escape(family)}(?:_\w+)?\{{[^}}]*\}}) (\S+)$", text, re.M)
    }


def test_metrics_show_histograms_gauges_with_the_tenant_label_and_pool_hits_as_p2p(servers):
    producer, consumer = servers
    prefix = prompt(92, 4 * BLOCK_SIZE)
    complete(producer, words(prefix))  # computes and saves the 4 prefix blocks
    pooled = complete(consumer, words(prefix + prompt(93, 10)))
    assert pooled.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK_SIZE

    text = scrape(consumer)
    for family, kind in (
        ("vllm:layerkv_load_wait_seconds", "histogram"),
        ("vllm:layerkv_transfer_seconds", "histogram"),
        ("vllm:layerkv_step_bytes", "histogram"),
        ("vllm:layerkv_lookup_seconds", "histogram"),
        ("vllm:layerkv_pending_puts", "gauge"),
        ("vllm:layerkv_staging_bytes_in_use", "gauge"),
        ("vllm:layerkv_running_jobs", "gauge"),
    ):
        assert f"# TYPE {family} {kind}" in text, family
        lines = samples_of(text, family)
        assert lines and all('tenant="default"' in name for name in lines), (
            family,
            lines,
        )  # the README's config: the default label
    counts = samples_of(text, "vllm:layerkv_load_wait_seconds")
    assert sum(v for k, v in counts.items() if k.startswith("vllm:layerkv_load_wait_seconds_count")) >= 1
    loaded = samples_of(text, "vllm:layerkv_step_bytes")
    assert sum(v for k, v in loaded.items() if "_sum{" in k and 'direction="load"' in k) > 0
    assert sum(v for k, v in samples_of(text, "vllm:layerkv_lookup_seconds").items() if "_count{" in k) >= 1
    # the pool's hits under the source vLLM knows for memory other processes lend (Mooncake): p2p
    by_source = samples_of(text, "vllm:prompt_tokens_cached_by_source")
    assert sum(v for k, v in by_source.items() if "_total{" in k and 'source="p2p"' in k) >= 4 * BLOCK_SIZE
    assert sum(v for k, v in by_source.items() if "_total{" in k and 'source="external_unspecified"' in k) == 0
    print(
        "\n".join(
            line
            for line in text.splitlines()
            if line.startswith(
                (
                    "vllm:layerkv_load_wait_seconds_count",
                    "vllm:layerkv_step_bytes_sum",
                    "vllm:layerkv_pending_puts",
                    "vllm:prompt_tokens_cached_by_source_total",
                )
            )
        )
    )
