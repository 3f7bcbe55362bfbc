"""The prose of suite `serving`'s report: what its engines, runs and columns are and how the
table reads (the notes under its title), and the load table's title. Pure: strings from the
grid and the rig's settings. Driver thread only.
"""

from __future__ import annotations

import json

from layerkv.bench.serving.grid import (
    BLOCK_SIZE,
    LOAD_MAX_TOKENS,
    LOAD_MISS_EVERY,
    LOAD_PREFIX_TOKENS,
    LOAD_PREFIXES,
    LOAD_SUFFIX_TOKENS,
    Grid,
)
from layerkv.bench.serving.report import LAYERKV, LAYERKV_DIRECT, LAYERKV_ENCRYPTED, LAYERKV_KEYED, TRANSFER
from layerkv.bench.serving.rig import DIRECT_EXTRA, LAYERKV_EXTRA, omp_bind

# --tenant-keys: the contenders it runs instead of recompute, the ceiling and MooncakeStoreConnector
TENANT_KEYS = (
    f"--tenant-keys: {LAYERKV} (no key), {LAYERKV_KEYED} (the same plus tenant_key_file: keyed names, a keyed "
    f"BLAKE3 MAC per layer and header, verified in staging) and {LAYERKV_ENCRYPTED} (plus encrypt_objects: "
    "AES-256-GCM per layer, decrypted in private memory); each has its own kv_producer with the same key "
    "settings, whose local-cache runs are its bit references. Recompute, the local-cache ceiling and "
    "MooncakeStoreConnector are left out (six engines is what this machine's memory holds), so their "
    "ratio columns are empty; the cost is the summary's '<keyed> / layerkv' per cell."
)


def load_table_title(grid: Grid) -> str:
    """The title of the throughput-under-load table."""
    return (
        f"Throughput under load: {grid.load_requests} concurrent requests, "
        f"{100 - 100 // LOAD_MISS_EVERY} % over {LOAD_PREFIXES} shared {LOAD_PREFIX_TOKENS}-token "
        f"prefixes, the rest with a prefix of their own; {LOAD_SUFFIX_TOKENS} own tokens each, "
        f"{LOAD_MAX_TOKENS} generated"
    )


def notes(grid: Grid, vllm_version: str, startup_s: dict[str, float | None]) -> list[str]:
    """The notes under the table: engines, timing, pool, contenders, columns, the load batch."""
    starts = ", ".join(f"{name} {s:.0f} s" for name, s in startup_s.items() if s is not None)
    return [
        f"vLLM {vllm_version} (CPU), random-weight Llama {grid.num_layers} layers x {grid.hidden_size} hidden "
        f"({grid.hidden_size // 128} KV heads x 128), {grid.dtype}, block {BLOCK_SIZE} tokens, "
        f"{grid.kv_bytes_per_token // 1024} KiB of KV per token; {grid.repeats} repeats per cell, every prompt new.",
        "TTFT = wall time of one `generate` with max_tokens=1 in the engine's front-end process, one request at a "
        "time; vLLM's local prefix cache is reset before every pool and recompute run, so a hit comes from the pool. "
        "Before the timed steps, one untimed step per prefix size for every contender (first loads of a size "
        "allocate buffers and open connections). Every timed recompute and pool run follows an untimed run of the "
        "same request in the same engine (cache reset before each: the same work); the ceiling's follows the "
        "prefix's own forward. An engine's first large forward after the others computed on these cores ran up to "
        "1.5x slower, whichever connector it had (before this, only the ceiling was timed warm).",
        f"one `layerkv master` pool (Mooncake over TCP loopback, one {grid.pool_bytes() >> 20} MiB segment in the "
        "master's process); both connectors' clients mount nothing (MooncakeStoreConnector in its standalone-store "
        "mode), so every load crosses a process boundary.",
        f"layerkv: kv_consumer with defaults plus {json.dumps(LAYERKV_EXTRA)} (transfer_plan auto, prefetch 2; "
        "only the staging area registered, every layer verified there before it is copied into the cache); "
        f"{LAYERKV_DIRECT}: the same plus {json.dumps(DIRECT_EXTRA)} (the live KV cache registered too, so the "
        "auto plan may also read layer by layer straight into it: the pre-staging data path). "
        f"{TRANSFER}: this benchmark process reads the prefix's layerkv objects whole (one batch_get_into) into "
        "its own registered memory with a bare Mooncake client, no compute; x_bound = TTFT / max(ceiling, "
        "transfer alone), the most any pool could reach in the cell. "
        "MooncakeStoreConnector: kv_consumer with its defaults (whole-block objects loaded before the forward pass, "
        "load_async). Producers: kv_producer engines of the same connector that computed the prefix.",
        f"VLLM_CPU_KVCACHE_SPACE={grid.engine_cache_gib()} GiB and VLLM_CPU_OMP_THREADS_BIND={omp_bind()} in every "
        f"engine; engine start-up (all six at once): {starts}.",
        "x_recompute / x_ceiling / x_mooncake_connector: this row's median TTFT over that contender's median in the "
        "same cell (< 1: faster). runs_cache_as_expected: runs whose num_cached_tokens was the whole prefix (0 for "
        "recompute); a pool miss recomputes, and its time stays in the median.",
        "tokens_equal_recompute: the first token equals recompute's. bits_equal_local_cache_run: token and logprob "
        "bits equal the same connector's producer serving the prefix from its local cache (same schedule); not "
        "compared with recompute, whose numerics differ without a connector. All runs: serving_runs.json.",
        f"Throughput under load: {grid.load_requests} requests in one `generate` (submitted at once) per contender, "
        f"{grid.load_repeats} repeats; every {LOAD_MISS_EVERY}th request's prefix is its own (a pool miss); "
        "batch_ms_median = wall time of the batch; ttft_ms = vLLM's own arrival -> "
        "first token per request (its RequestStateStats), mean and p90 over all requests; requests sharing a prefix "
        "also share vLLM's local prefix cache within the batch, in every contender. Tokens (16 per request, greedy, "
        "random weights) are compared per request with recompute's and with the local-prefix-cache ceiling's: under "
        "batching a request whose prefix was cached and one whose prefix was computed may differ in vLLM's numerics "
        "(every cached contender alike), so the ceiling is the comparison for pool hits.",
    ]
