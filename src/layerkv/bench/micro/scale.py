"""Suite `scale`: how layerkv's own cost grows with prompt length (1k -> 32k tokens) and
layers: scheduler lookup, one save step and one load step through the connectors on synthetic
numpy caches (embedded store), wall time and Python memory (tracemalloc peak). Driver thread
(the compute thread); the connector's send / receive threads run inside each step.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import tracemalloc
from pathlib import Path

import numpy as np

from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult
from layerkv.bench.plots import line_plot
from layerkv.bench.steps import drive_step
from layerkv.config import LayerKVConfig
from layerkv.connector import SchedulerConnector, WorkerConnector
from layerkv.messages import Deployment, RequestView
from layerkv.metadata import BlockSpec, StepPlan, StepVerdict
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore

NAME = "scale"
BLOCK_SIZE = 16
_runs = itertools.count()
_seqs = itertools.count()


class _Setup:
    """Connectors for one layer count over one embedded store; caches [2, blocks, 16, 1, 32] f16."""

    def __init__(self, num_layers: int, max_tokens: int) -> None:
        self.num_blocks = max_tokens // BLOCK_SIZE + 4
        self.caches = {
            f"model.layers.{i}.self_attn.attn": np.zeros((2, self.num_blocks, BLOCK_SIZE, 1, 32), dtype=np.float16)
            for i in range(num_layers)
        }
        deployment = Deployment(
            model_id="bench/scale",
            kv_dtype="float16",
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            kv_signature=f"scale-L{num_layers}",
        )
        config = LayerKVConfig.from_dict({}, env={})
        self.backend = EmbeddedStore(capacity_bytes=1 << 30)
        self.store = CheckedStore(self.backend, max_batch_keys=config.max_transfer_blocks)
        self.scheduler = SchedulerConnector(config, deployment, self.store)
        self.worker = WorkerConnector(config, deployment, self.store)
        self.worker.register_kv_caches(self.caches, self.num_blocks)
        self.layer_names = list(self.caches)

    def step(self, plan: StepPlan, load: bool) -> None:
        """A load step (every layer waited for) or a save step (every layer handed over)."""
        drive_step(self.worker, plan, self.layer_names, load=load, save=not load)

    def one_pass(self, prompt_tokens: int) -> dict[str, float]:
        """Save, look up and load one prompt's blocks; returns seconds per phase."""
        num = prompt_tokens // BLOCK_SIZE
        run = next(_runs)
        hashes = tuple(hashlib.sha256(f"scale:{run}:{i}".encode()).digest()[:16] for i in range(num))
        ids = tuple(range(num))
        times = {}
        start = time.perf_counter()  # the save step, then the next step carrying its commit verdict
        save_seq, commit_seq = next(_seqs), next(_seqs)
        self.step(StepPlan(step_seq=save_seq, saves=(BlockSpec("r", hashes, ids),)), load=False)
        self.step(StepPlan(step_seq=commit_seq, verdicts=(StepVerdict(save_seq),)), load=False)
        self.worker.flush()
        times["save_ms"] = time.perf_counter() - start
        start = time.perf_counter()
        hit, _ = self.scheduler.get_num_new_matched_tokens(
            RequestView(f"r{run}", prompt_tokens + 1, prompt_tokens + 1, hashes), 0
        )
        times["lookup_ms"] = time.perf_counter() - start
        if hit != num * BLOCK_SIZE:
            raise RuntimeError(f"scale: lookup found {hit} tokens of {num * BLOCK_SIZE} just saved")
        start = time.perf_counter()
        self.step(
            StepPlan(step_seq=next(_seqs), loads=(BlockSpec(f"r{run}", hashes, ids),), ended_req_ids=frozenset({"r"})),
            load=True,
        )
        times["load_ms"] = time.perf_counter() - start
        stats = self.worker.stats()
        if stats.load_failed_blocks or stats.save_failed_keys:
            raise RuntimeError(f"scale: failures during the pass: {stats}")
        self.store.batch_remove(_keys(self.worker, hashes))
        return {k: v * 1e3 for k, v in times.items()}

    def close(self) -> None:
        self.worker.shutdown()
        self.backend.close()


def _keys(worker: WorkerConnector, hashes: tuple[bytes, ...]) -> list[str]:
    from layerkv.objects.keys import block_keys

    return block_keys(worker.namespace, hashes, worker.storage_role.storage_rank)


def measure(setup: _Setup, num_layers: int, prompt_tokens: int, reps: int) -> Row:
    setup.one_pass(prompt_tokens)  # warm-up (first-touch of caches, arena)
    passes = [setup.one_pass(prompt_tokens) for _ in range(reps)]
    best = {k: min(p[k] for p in passes) for k in passes[0]}
    tracemalloc.start()
    try:
        setup.one_pass(prompt_tokens)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kv_nbytes = (prompt_tokens // BLOCK_SIZE) * num_layers * 2 * BLOCK_SIZE * 32 * 2
    return {
        "prompt_tokens": prompt_tokens,
        "layers": num_layers,
        "blocks": prompt_tokens // BLOCK_SIZE,
        "kv_mib": kv_nbytes / (1 << 20),
        **best,
        "python_peak_mib": peak / (1 << 20),
        "python_peak_over_kv": peak / kv_nbytes,
        "us_per_block_layer_load": best["load_ms"] * 1e3 / ((prompt_tokens // BLOCK_SIZE) * num_layers),
    }


def grid(options: BenchOptions) -> dict[int, tuple[int, ...]]:
    """layers -> the prompt lengths measured with that many layers."""
    if options.tiny:
        return {4: (1024, 2048)}
    if options.quick:
        return {8: (1024, 4096, 16384, 32768), 32: (4096,)}
    return {8: (1024, 2048, 4096, 8192, 16384, 32768), 2: (8192,), 16: (8192,), 32: (8192, 32768), 64: (8192,)}


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    layers_grid = grid(options)
    reps = 1 if options.tiny else 2 if options.quick else 3
    for num_layers, prompts in layers_grid.items():
        setup = _Setup(num_layers, max(prompts))
        try:
            for tokens in prompts:
                progress.case(f"{NAME} L{num_layers} {tokens} tokens")
                result.rows.append(measure(setup, num_layers, tokens, reps))
        finally:
            setup.close()
    result.notes += [
        "one pass = a save step (put sessions, one range call per layer per 64 blocks, commit), the scheduler lookup "
        "(windowed exists) and a load step (get sessions, layerwise reads) of every block of the prompt through the "
        "connectors; caches [2, blocks, 16, 1, 32] float16 per layer (1 KiB per entry); embedded store; best of the "
        "passes.",
        "python_peak_mib = tracemalloc peak during one pass (layerkv's Python objects: range lists, keys, plans; "
        "the KV bytes live in numpy / the store arena and are not traced).",
    ]
    # the layer count with the most prompt lengths: the length sweep
    sweep_layers = min(layers_grid, key=lambda li: -len(layers_grid[li]))
    _report_length_sweep(result, [r for r in result.rows if r["layers"] == sweep_layers], options.out_dir)
    return result


def _report_length_sweep(result: SuiteResult, rows: list[Row], out_dir: Path) -> None:
    """Headlines (growth per doubling of the prompt, the longest prompt's load time and peak) and
    the time and memory plots of one layer count's prompt lengths."""
    by_len = sorted(rows, key=lambda r: r["prompt_tokens"])
    if by_len:
        result.summary["load_ms_growth_per_token_doubling"] = (by_len[-1]["load_ms"] / by_len[0]["load_ms"]) ** (
            1 / max(1e-9, np.log2(by_len[-1]["prompt_tokens"] / by_len[0]["prompt_tokens"]))
        )
        result.summary[f"load_ms@{by_len[-1]['prompt_tokens']}tok_L{by_len[-1]['layers']}"] = by_len[-1]["load_ms"]
        result.summary[f"python_peak_mib@{by_len[-1]['prompt_tokens']}tok_L{by_len[-1]['layers']}"] = by_len[-1][
            "python_peak_mib"
        ]
        xs = [r["prompt_tokens"] for r in by_len]
        result.plots.append(
            line_plot(
                out_dir / "scale_time.png",
                xs,
                {k: [r[k] for r in by_len] for k in ("save_ms", "lookup_ms", "load_ms")},
                title=f"layerkv cost vs prompt length ({by_len[0]['layers']} layers)",
                xlabel="prompt tokens",
                ylabel="ms",
                logx=True,
                logy=True,
            )
        )
        result.plots.append(
            line_plot(
                out_dir / "scale_memory.png",
                xs,
                {"python peak MiB": [r["python_peak_mib"] for r in by_len], "KV MiB": [r["kv_mib"] for r in by_len]},
                title="memory vs prompt length",
                xlabel="prompt tokens",
                ylabel="MiB",
                logx=True,
                logy=True,
            )
        )
