"""What the real-engine tier's tests and fixtures share: engine settings (block size, tenant),
the engines' environment and kv_transfer_config, the README's `vllm serve` command, and the
bit-for-bit output check. No fixtures here (conftest.py)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from layerkv.bench.vllm.engines import engine_env as bench_engine_env
from layerkv.store.mooncake_master import MasterPorts
from tests.vllm_engine.engine_proc import ServeProcess

REPO = Path(__file__).parents[2]
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
TENANT = "engine-tier"
README = REPO / "README.md"
DOCS_VLLM = REPO / "docs" / "vllm.md"
MODEL_NAME = "tiny-llama"
# What the README leaves to the deployment: a model this CPU can serve, its KV blocks and dtype,
# loopback, and prompt-token details in the usage block (to see the pool hit).
TEST_FLAGS = [
    "--host",
    "127.0.0.1",
    "--served-model-name",
    MODEL_NAME,
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-model-len",
    "1024",
    "--num-gpu-blocks-override",
    "256",
    "--enforce-eager",
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
    "--uvicorn-log-level",
    "warning",
]


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two engine outputs (engine_host's dicts) agree token for token and bit for bit."""
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"], "logprobs differ in their bits"


def pool_diagnosis(*engines: Any) -> str:
    """For an assertion message: each engine's non-zero layerkv counters and the layerkv warnings
    in its log (why a hit was missed or a load recomputed)."""
    parts = []
    for engine in engines:
        counters = {k: v for k, v in sorted(engine.call("metrics")["layerkv"].items()) if v}
        try:
            lines = engine.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            lines = [f"(log unreadable: {exc})"]
        warnings = [line[:300] for line in lines if "layerkv:" in line][-12:]  # layerkv's own log lines
        parts.append(f"{engine.name}: {counters}\n  " + "\n  ".join(warnings))
    return "\n".join(parts)


def engine_env(mooncake_config: Path | None, fault_dir: Path, **extra: str) -> dict[str, str]:
    """The bench's engine environment (loopback only, quiet), the repo root first on PYTHONPATH
    (tests.vllm_engine.* for the hosts and the faulty connector), small KV space, faults dir."""
    tier = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the engines below also cap their block count
        "LAYERKV_TEST_FAULT_DIR": str(fault_dir),
    }
    if mooncake_config is not None:
        tier["MOONCAKE_CONFIG_PATH"] = str(mooncake_config)
    return bench_engine_env(REPO, {**tier, **extra})


# The tier starts all its engines at once (~20 processes on 2 cores, conftest.py) and its tests
# check outputs and pool use, not latency: layerkv's time bounds are widened here so that a
# starved master or transfer thread is not taken for an outage (a 2 s master call is one by
# default: the pool is skipped, correctly, and a test expecting a hit fails). The bounds
# themselves are tested with injected stalls in the main suite.
TIER_BOUNDS = {"store_call_timeout_s": 30.0, "load_timeout_s": 60.0, "save_timeout_s": 60.0}


def layerkv_transfer(
    kv_role: str,
    *,
    backend: str = "mooncake",
    connector: str = "LayerKVConnector",
    module: str = "layerkv.integrations.vllm",
    multi: bool = False,
) -> dict[str, Any]:
    child = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": kv_role,
        "kv_connector_extra_config": {"backend": backend, "tenant": TENANT, **TIER_BOUNDS},
    }
    if multi:
        return {
            "kv_connector": "MultiConnector",
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [child]},
        }
    return {**child, "kv_load_failure_policy": "recompute"}


def llm_kwargs(model_dir: Path, transfer: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        seed=0,
        max_model_len=1024,
        max_num_batched_tokens=64,  # 64: prompts prefill in chunks of 2 blocks
        num_gpu_blocks_override=256,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=transfer,
    )
    kwargs.update(overrides)
    return kwargs


def readme_serve_argv() -> list[str]:
    """The `vllm serve ...` command of the README's "Use with vLLM" section, as argv."""
    section = README.read_text().split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "vllm serve" in b]
    command = block[block.index("vllm serve") :]
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


def pd_serve_argv(role: str) -> list[str]:
    """The first prefill ("prefill": kv_producer) or decode ("decode": kv_consumer) `vllm serve ...`
    command of docs/vllm.md's prefill/decode section (2 of each), as argv, without its --port."""
    section = DOCS_VLLM.read_text().split("## Prefill/decode disaggregation", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "layerkv pd-proxy" in b]
    commands = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.startswith("vllm serve")]
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    chosen = [argv for argv in commands if f'"kv_role": "{kv_role}"' in " ".join(argv)]
    assert len(commands) == 4 and len(chosen) == 2, commands  # 2 prefill x 2 decode servers
    argv = chosen[0]  # the tier runs one of each
    port = argv.index("--port")
    return argv[:port] + argv[port + 2 :]


def serve_process(name: str, model_dir: Path, mooncake_config: Path, fault_dir: Path, log_dir: Path) -> ServeProcess:
    """Start one server with the README's command, or serve-prefill / serve-decode with docs/vllm.md's
    prefill/decode commands (the fleet stops it at the end)."""
    port = MasterPorts.pick().rpc_port  # a free loopback port
    pd = {"serve-prefill": "prefill", "serve-decode": "decode"}.get(name)
    argv = pd_serve_argv(pd) if pd else readme_serve_argv()
    command = [*vllm_serve(), str(model_dir), *argv[3:], "--port", str(port), *TEST_FLAGS]
    env = engine_env(mooncake_config, fault_dir)
    if "--tensor-parallel-size" in argv:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank, as the tier's tp2
    return ServeProcess(name, command, port, env, log_dir)
