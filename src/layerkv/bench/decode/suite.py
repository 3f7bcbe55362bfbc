"""Suite `decode` (opt-in): a KV connector's host cost per engine step in steady-state decode,
through vLLM's REAL Scheduler and REAL worker hook path (engine.py) with N requests
decoding. Contenders (contenders.py): layerkv (embedded store; Mooncake), vLLM's MooncakeStoreConnector
(as is; with save_decode_cache), no connector. Connector hooks are timed on the connector instances
(meters.py). Driver thread only; the connectors' transfer threads run beside the steps.
"""

from __future__ import annotations

import importlib.util
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult
from layerkv.bench.decode.contenders import LAYERKV_EMBEDDED, NONE, Contender, contenders
from layerkv.bench.decode.engine import (
    BLOCK_SIZE,
    VLLM_CPU_ENV,
    DecodeEngine,
    EngineShape,
    StepTimes,
    environ,
    write_model,
)
from layerkv.bench.decode.meters import EngineMeters, StepSample, hook_rows, summarize, warmup_row

NAME = "decode"
PROMPT_TOKENS = 40  # not a multiple of 16: most decode steps complete no block
IDLE, BLOCK = "no block completes", "a block completes"
MAX_PREFILL_STEPS = 64  # warm-up bound: every request must be decoding by then
DRAIN_TIMEOUT_S = 600.0  # a peer's queued saves are waited for this long before its engine stops


@dataclass(frozen=True, slots=True)
class Sizes:
    batch_sizes: tuple[int, ...]
    num_layers: int
    timed_steps: int
    warm_decode_steps: int  # decode steps after the last prefill before timing (prefill saves settle)

    def shape(self, model_dir: Path, num_requests: int) -> EngineShape:
        max_tokens = self.warm_decode_steps + self.timed_steps + 8
        max_model_len = -(-(PROMPT_TOKENS + max_tokens) // BLOCK_SIZE) * BLOCK_SIZE
        # every request's blocks fit at once: nothing is preempted
        num_blocks = num_requests * (max_model_len // BLOCK_SIZE) + 8
        max_num_seqs = max(num_requests, 8)
        # every prompt in one step: all requests then share one length (blocks complete together)
        batched_tokens = min(max(8192, num_requests * PROMPT_TOKENS), max_num_seqs * max_model_len)
        return EngineShape(model_dir, self.num_layers, max_num_seqs, num_blocks, max_model_len, batched_tokens)


def sizes(options: BenchOptions) -> Sizes:
    if options.tiny:
        return Sizes((1, 4), num_layers=4, timed_steps=8, warm_decode_steps=2)
    if options.quick:
        return Sizes((1, 16, 64, 256), num_layers=32, timed_steps=64, warm_decode_steps=16)
    return Sizes((1, 16, 64, 256), num_layers=32, timed_steps=256, warm_decode_steps=16)


# --------------------------------------------------------------------------- one run


@dataclass(slots=True)
class RunResult:
    """One run: the timed steps, and the untimed warm-up (arrival, prefill, first decode steps)
    summed into one sample."""

    samples: list[StepSample]
    warmup: StepSample
    warmup_steps: int
    store_chunks: int  # backend calls (CheckedStore chunks) in the timed steps, a cross-check of the counters
    notes: list[str] = field(default_factory=list)


def prompts(num_requests: int, salt: int) -> list[list[int]]:
    """Distinct prompts of PROMPT_TOKENS tokens (ids 3..502), distinct across runs by `salt`."""
    rng = random.Random(salt)
    return [
        [3 + i % 500, 3 + (i // 500) % 500, *(rng.randrange(3, 503) for _ in range(PROMPT_TOKENS - 2))]
        for i in range(num_requests)
    ]


def _stores_of(engine: DecodeEngine) -> list[Any]:
    """The store objects layerkv's facades hold (`_store`; one per connector), deduplicated."""
    found: dict[int, Any] = {}
    for connector in (engine.scheduler_connector, engine.worker.connector if engine.worker else None):
        store = getattr(connector, "_store", None)
        if store is not None:
            found[id(store)] = store
    return list(found.values())


def _chunk_calls(stores: list[Any]) -> int:
    return sum(s.calls for store in stores if hasattr(store, "stats") for s in store.stats().values())


def measure(contender: Contender, shape: EngineShape, num_requests: int, sizes_: Sizes, run_idx: int) -> RunResult:
    """One engine for `contender` with `num_requests` requests: arrival, prefill and
    `warm_decode_steps` metered as one warm-up sample, then `timed_steps` metered steps."""
    with environ(contender.env), tempfile.TemporaryDirectory(prefix="layerkv-decode-run-") as run_dir:
        transfer = contender.transfer(f"bench-decode-{os.getpid()}-{run_idx}", run_idx)
        engine = DecodeEngine(shape, transfer, Path(run_dir) if contender.worker_process else None)
        meters: EngineMeters | None = None
        try:
            stores = _stores_of(engine)
            meters = EngineMeters.install(
                engine.scheduler_connector, engine.worker.connector if engine.worker else None, stores
            )
            engine.add_requests(prompts(num_requests, salt=run_idx), sizes_.warm_decode_steps + sizes_.timed_steps + 8)
            warmup_steps = _warm_up(engine, num_requests, sizes_.warm_decode_steps)
            warmup = meters.take(StepTimes(0, 0, 0, False, 0))
            chunks_before = _chunk_calls(stores)
            samples = [meters.take(engine.step()) for _ in range(sizes_.timed_steps)]
            run = RunResult(samples, warmup, warmup_steps, _chunk_calls(stores) - chunks_before)
            short = [s.times.num_decoding for s in samples if s.times.num_decoding != num_requests]
            if short:
                run.notes.append(
                    f"{contender.name} N={num_requests}: {len(short)} timed steps had only {min(short)} requests "
                    "decoding"
                )
            backlog = _drain_peer_saves(engine)
            if backlog:
                run.notes.append(f"{contender.name} N={num_requests}: {backlog}")
            return run
        finally:
            if meters is not None:
                meters.remove()
            engine.shutdown()
            if contender.name == LAYERKV_EMBEDDED:
                from layerkv.store.process_stores import close_shared_stores

                close_shared_stores()  # frees the run's objects (the next run has its own tenant anyway)


def _drain_peer_saves(engine: DecodeEngine) -> str:
    """MooncakeStoreConnector saves on its own send thread, from a queue: what is still queued
    when the timed steps end is its save backlog. Waited for (up to DRAIN_TIMEOUT_S) before the
    engine stops: its close waits 5 s, then closes the store under the thread (which crashed
    this process with thousands queued). "" for a connector without such a queue."""
    worker = getattr(engine.worker.connector, "connector_worker", None) if engine.worker is not None else None
    queue = getattr(getattr(worker, "kv_send_thread", None), "request_queue", None)
    if queue is None or not queue.unfinished_tasks:
        return ""
    queued, start = queue.unfinished_tasks, time.monotonic()
    while queue.unfinished_tasks and time.monotonic() - start < DRAIN_TIMEOUT_S:
        time.sleep(0.05)
    left = queue.unfinished_tasks
    return f"{queued} save requests still queued on its send thread when the timed steps ended; " + (
        f"drained {time.monotonic() - start:.1f} s later" if not left else f"{left} left after {DRAIN_TIMEOUT_S:.0f} s"
    )


def _warm_up(engine: DecodeEngine, num_requests: int, warm_decode_steps: int) -> int:
    """Steps until every request decodes (that step included), then `warm_decode_steps` more;
    returns the number of steps taken."""
    num_steps = 1
    while engine.step().num_decoding < num_requests:
        num_steps += 1
        if num_steps > MAX_PREFILL_STEPS:
            raise RuntimeError(f"decode: {num_requests} requests not all decoding after {num_steps} steps")
    for _ in range(warm_decode_steps):
        engine.step()
    return num_steps + warm_decode_steps


def _add_pct_of_schedule(rows: list[Row]) -> None:
    """host_us_p50 as % of vLLM's own schedule() (the `none` run's, same N and kind of step)."""
    base = {(r["requests"], r["steps"]): r["schedule_us_p50"] for r in rows if r["contender"] == NONE}
    for r in rows:
        ref = base.get((r["requests"], r["steps"]))
        r["pct_of_schedule"] = 100 * r["host_us_p50"] / ref if r["host_us_p50"] is not None and ref else None


# --------------------------------------------------------------------------- the suite


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    if importlib.util.find_spec("vllm") is None:
        result.notes.append("skipped: vllm is not installed in this Python (the suite drives vLLM's own scheduler)")
        return result
    with environ(VLLM_CPU_ENV):  # before the first vllm import; restored for the suites after this one
        _measure_all(options, progress, result)
    return result


def _measure_all(options: BenchOptions, progress: Progress, result: SuiteResult) -> None:
    size = sizes(options)
    hooks: list[Row] = []
    warmups: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="layerkv-decode-") as tmp,
        contenders(options, Path(tmp), result.notes) as found,
    ):
        model_dir = write_model(Path(tmp) / "model", size.num_layers)
        for c_idx, contender in enumerate(found):
            for n_idx, num_requests in enumerate(size.batch_sizes):
                progress.case(f"{NAME} {contender.name} N={num_requests}")
                try:
                    run_ = measure(
                        contender, size.shape(model_dir, num_requests), num_requests, size, c_idx * 16 + n_idx
                    )
                except Exception as exc:  # noqa: BLE001 - a contender that cannot run here is reported, not faked
                    result.notes.append(
                        f"{contender.name} N={num_requests} did not run: {type(exc).__name__}: {_short(exc)}"
                    )
                    break
                result.notes += run_.notes
                warmups.append(warmup_row(contender.name, num_requests, run_.warmup_steps, run_.warmup))
                for kind, block in ((IDLE, False), (BLOCK, True)):
                    picked = [s for s in run_.samples if s.times.block_completes == block]
                    if picked:
                        result.rows.append(summarize(contender.name, num_requests, kind, picked))
                        if num_requests == max(size.batch_sizes):
                            hooks += [{"steps": kind, **r} for r in hook_rows(contender.name, picked)]
                _cross_check(result, contender.name, num_requests, run_)
    _add_pct_of_schedule(result.rows)
    result.tables[f"per hook at N={max(size.batch_sizes)}"] = hooks
    result.tables["warm-up (arrival, prefill, first decode steps; untimed in the rows above)"] = warmups
    _summary(result, max(size.batch_sizes))
    import vllm

    result.notes += _method_notes(size, str(getattr(vllm, "__version__", "?")))
    _plot(result, options)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else repr(exc)


def _cross_check(result: SuiteResult, contender: str, num_requests: int, run_: RunResult) -> None:
    counted = sum(s.stores.total() for s in run_.samples if s.stores is not None)
    if run_.store_chunks > 0 and counted == 0:
        result.notes.append(
            f"{contender} N={num_requests}: the store made {run_.store_chunks} backend calls the "
            "counters did not see (a store method bound before the counters were installed?)"
        )


def _summary(result: SuiteResult, max_n: int) -> None:
    for r in result.rows:
        if r["requests"] != max_n:
            continue
        key = f"{r['contender']}.N{max_n}.{'idle' if r['steps'] == IDLE else 'block'}"
        if r["host_us_p50"] is not None:
            result.summary[f"{key}.host_us_p50"] = r["host_us_p50"]
        if r["steps"] == IDLE and r["store_calls_driver"] is not None:
            result.summary[f"{key}.store_calls_sched_thread_per_step"] = r["store_calls_driver"]
        if r["contender"] == NONE:
            result.summary[f"{key}.schedule_us_p50"] = r["schedule_us_p50"]


def _method_notes(size: Sizes, vllm_version: str) -> list[str]:
    return [
        f"vLLM {vllm_version}'s real Scheduler and worker hook path in one process on CPU (no model: each step samples "
        "one token per "
        f"request whose prompt is done): {size.num_layers} layers, block size 16, N requests with distinct "
        f"{PROMPT_TOKENS}-token prompts, prefilled and decoded {size.warm_decode_steps} steps untimed, then "
        f"{size.timed_steps} timed decode steps. Nothing is in the pool (a fresh layerkv tenant per run): no loads; "
        "blocks that fill during decode are saved.",
        "sched_us / worker_us: per step, the summed host time of the connector instance's hooks (timed on the "
        "instance: what vLLM's scheduler, ActiveKVConnector and the per-layer maybe_transfer_kv_layer wrapper call; "
        "a hook calling another is counted once); host = sched + worker; p50 / p90 over the steps of that kind. "
        "wait_load_us / save_layer_us: mean per call of the per-layer hooks (calls: over those steps).",
        "steps: 'a block completes' = some request's (computed + scheduled) // 16 passes computed // 16 in that "
        "step (all requests share one length, so every 16th step); the other steps complete none.",
        "schedule_us_p50: vLLM's schedule() wall time (the connector hooks it calls included); pct_of_schedule = "
        "host_us_p50 / the `none` run's schedule_us_p50 at the same N and kind of step. store_calls_*: layerkv's "
        "store calls per step (each connector's CheckedStore, nested calls once); driver = the thread that runs "
        "schedule() (here also the worker's hooks, as vLLM's uni executor does); total adds the transfer threads.",
        "The driver thread runs everything here; numbers depend on the machine's load (transfer threads share the "
        "cores).",
    ]


def _plot(result: SuiteResult, options: BenchOptions) -> None:
    idle = [r for r in result.rows if r["steps"] == IDLE]
    batch_sizes = sorted({r["requests"] for r in idle})
    groups: dict[str, list[float]] = {}
    for name in dict.fromkeys(r["contender"] for r in idle):
        by_n = {r["requests"]: r for r in idle if r["contender"] == name}
        column = "schedule_us_p50" if name == NONE else "host_us_p50"
        label = "vLLM schedule() (no connector)" if name == NONE else f"{name} hooks"
        groups[label] = [float(by_n[n][column]) if n in by_n and by_n[n][column] else 0.0 for n in batch_sizes]
    if not groups:
        return
    from layerkv.bench.plots import bar_plot

    result.plots.append(
        bar_plot(
            options.out_dir / "decode_host_us.png",
            [f"N={n}" for n in batch_sizes],
            groups,
            title="host µs per decode step with no block completing (p50)",
            ylabel="µs",
            logy=True,
        )
    )
