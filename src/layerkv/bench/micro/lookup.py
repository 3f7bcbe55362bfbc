"""Suite `lookup`: scheduler hit queries on long prompts at 0 / 10 / 50 / 100 % pool hits —
SchedulerConnector.get_num_new_matched_tokens (windowed exists, stops at the first window with
a miss) vs one PoolLookup.present query over every block (the original design). Counts exists
calls (layerkv's and the backend's), keys queried and time. Driver thread only.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import numpy as np

from layerkv.bench.backends import Backend, open_backends
from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, ratio
from layerkv.bench.plots import bar_plot
from layerkv.config import LayerKVConfig
from layerkv.connector.scheduler import SchedulerConnector
from layerkv.messages import Deployment, RequestView
from layerkv.objects.keys import block_keys
from layerkv.store.checked import CheckedStore

NAME = "lookup"
BLOCK_SIZE = 16
HIT_RATES = (0.0, 0.1, 0.5, 1.0)
OBJECT_NBYTES = 64  # the lookup only asks whether keys exist; tiny objects suffice
DEPLOYMENT = Deployment(
    model_id="bench/lookup", kv_dtype="bfloat16", block_size=BLOCK_SIZE, num_kv_heads=8, kv_signature="bench-lookup"
)


def _hashes(tag: str, num_blocks: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest()[:16] for i in range(num_blocks)]


def _populate(store: CheckedStore, keys: list[str]) -> None:
    buf = np.zeros(OBJECT_NBYTES, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        results = store.batch_put_from(keys, [buf.ctypes.data] * len(keys), [OBJECT_NBYTES] * len(keys))
    finally:
        store.unregister_buffer(buf.ctypes.data)
    bad = sorted({r for r in results if r != 0})
    if bad:
        raise RuntimeError(f"lookup: populating {len(keys)} keys returned {bad}")


def measure(backend: Backend, prompt_tokens: int, window_blocks: int, reps: int, one_query: bool = True) -> list[Row]:
    num_blocks = prompt_tokens // BLOCK_SIZE
    store = CheckedStore(backend.store, max_batch_keys=64)
    config = LayerKVConfig.from_dict({"exists_window_blocks": window_blocks}, env={})
    connector = SchedulerConnector(config, DEPLOYMENT, store)
    present = _hashes(f"present-{prompt_tokens}", num_blocks)
    keys = block_keys(connector.namespace, present, 0)
    _populate(store, keys)
    rows = []
    try:
        for hit_rate in HIT_RATES:
            num_hit = int(num_blocks * hit_rate)
            hashes = tuple(present[:num_hit] + _hashes(f"absent-{prompt_tokens}-{hit_rate}", num_blocks - num_hit))
            request = RequestView("bench", prompt_tokens + 1, prompt_tokens + 1, hashes)
            for variant in ("windowed", "one query") if one_query else ("windowed",):
                times, counts = [], None
                for _ in range(reps):
                    store.reset_stats()
                    before = (connector.stats().exists_calls, connector.stats().keys_queried)
                    start = time.perf_counter()
                    if variant == "windowed":
                        hit_tokens, _ = connector.get_num_new_matched_tokens(request, 0)
                        hit = (hit_tokens or 0) // BLOCK_SIZE  # no kv_transfer_params: never None
                    else:
                        flags = connector._lookup.present(list(hashes))  # the bench reuses the scheduler's lookup
                        hit = next((i for i, f in enumerate(flags) if not f), len(flags))
                    times.append(time.perf_counter() - start)
                    backend_calls = store.stats()["batch_is_exist"].calls
                    counts = (
                        connector.stats().exists_calls - before[0],
                        connector.stats().keys_queried - before[1],
                        backend_calls,
                        hit,
                    )
                assert counts is not None
                rows.append(
                    {
                        "backend": backend.name,
                        "prompt_tokens": prompt_tokens,
                        "blocks": num_blocks,
                        "hit_rate": hit_rate,
                        "variant": variant,
                        "window_blocks": window_blocks if variant == "windowed" else num_blocks,
                        "hit_blocks": counts[3],
                        "exists_calls": counts[0],
                        "backend_exists_calls": counts[2],
                        "keys_queried": counts[1],
                        "ms": statistics.median(times) * 1e3,
                    }
                )
    finally:
        store.batch_remove(keys)
    return rows


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    prompts = (1024,) if options.tiny else ((8192, 131072) if options.quick else (4096, 32768, 131072))
    windows = (32,) if options.tiny or options.quick else (32, 256)
    with open_backends(options.mooncake, remote=False) as backends:  # the exists query is a master RPC either way
        for backend in backends:
            for prompt_tokens in prompts:
                for window in windows:
                    progress.case(f"{NAME} {backend.name} {prompt_tokens} tokens window {window}")
                    result.rows.extend(
                        measure(backend, prompt_tokens, window, options.reps, one_query=window == windows[0])
                    )
    result.notes += [
        "windowed = SchedulerConnector.get_num_new_matched_tokens (exists_window_blocks per query, stops at the "
        "first window with a miss); one query = PoolLookup.present over every block, then the first miss.",
        "the hit blocks are the prompt's first blocks; the rest are absent. A full hit keeps the last token, so the "
        "windowed lookup asks for all blocks of a prompt of N blocks + 1 token. backend_exists_calls counts the "
        "CheckedStore chunks (at most 64 keys each) sent to the store.",
    ]
    _summarise(result)
    big_rows = [
        r
        for r in result.rows
        if r["prompt_tokens"] == max(r["prompt_tokens"] for r in result.rows)
        and r["window_blocks"] in (32, r["blocks"])
    ]
    labels = [f"{r['backend']} {int(r['hit_rate'] * 100)}%" for r in big_rows if r["variant"] == "windowed"]
    groups = {v: [r["ms"] for r in big_rows if r["variant"] == v] for v in ("windowed", "one query")}
    result.plots.append(
        bar_plot(
            options.out_dir / "lookup_ms.png",
            labels,
            groups,
            title=f"hit lookup on a {big_rows[0]['prompt_tokens']}-token prompt",
            ylabel="ms",
            logy=True,
        )
    )
    return result


def _summarise(result: SuiteResult) -> None:
    """Headlines per backend and hit rate on the longest prompt: one query over the windowed
    lookup (32-block windows), in keys queried and in time."""
    for backend in sorted({r["backend"] for r in result.rows}):
        big = max(r["prompt_tokens"] for r in result.rows)
        for hit in HIT_RATES:
            w = next(
                r
                for r in result.rows
                if r["backend"] == backend
                and r["prompt_tokens"] == big
                and r["hit_rate"] == hit
                and r["variant"] == "windowed"
                and r["window_blocks"] == 32
            )
            o = next(
                r
                for r in result.rows
                if r["backend"] == backend
                and r["prompt_tokens"] == big
                and r["hit_rate"] == hit
                and r["variant"] == "one query"
            )
            result.summary[f"{backend}.{big}tok.hit{int(hit * 100)}.keys_one_over_windowed"] = ratio(
                o["keys_queried"], w["keys_queried"]
            )
            result.summary[f"{backend}.{big}tok.hit{int(hit * 100)}.time_one_over_windowed"] = ratio(o["ms"], w["ms"])
