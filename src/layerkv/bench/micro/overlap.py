"""Suite `overlap`: time to first token on the reference engine for a prompt whose first 90 %
is in the pool — recompute everything; load everything, then compute; layerwise with prefetch
1, 2, 4 — and the fraction of transfer time hidden behind compute, also with store latency
injected per range call so that transfer ~ compute and ~ 2 x compute. Driver thread (the
engine's compute thread); layerkv's receive thread runs inside each request. The engines: overlap_rig.py.

    hidden = (transfer alone + compute alone - layerwise TTFT) / transfer alone
"""

from __future__ import annotations

from typing import Any

from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, ratio
from layerkv.bench.micro.overlap_rig import HIT_FRACTION, Rig, best_of
from layerkv.bench.plots import bar_plot

NAME = "overlap"
CONDITIONS = (("no delay", None), ("transfer ~ compute", 1.0), ("transfer ~ 2x compute", 2.0))
SAVE_VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("staged", "defaults (staged images)", {}),
    ("direct", "register_kv_cache, per-layer writes", {"transfer_plan": "layers", "register_kv_cache": True}),
)


def _conditions(
    rig: Rig,
    result: SuiteResult,
    progress: Progress,
    reps: int,
    prefetches: tuple[int, ...],
    conditions: tuple[tuple[str, float | None], ...],
    tag: str = "",
) -> float:
    """Rows and headlines of `conditions` on `rig`'s model (`tag` names a second model in both);
    returns the recompute-all TTFT."""
    recompute = best_of(rig.ttft_recompute, reps)
    compute = best_of(rig.ttft_compute_alone, reps)
    _, transfer0, range_calls, *_ = best_of(lambda: rig.ttft_pooled(rig.model.num_layers, 0.0, True), reps)
    for label, target in conditions:
        delay_s = 0.0 if target is None else max(0.0, (target * compute - transfer0) / max(1, range_calls))
        condition = f"{label}{tag}"
        progress.case(f"{NAME} {condition}")
        t_all, transfer, _, _, copy_s, copied = best_of(
            lambda: rig.ttft_pooled(rig.model.num_layers, delay_s, True), reps
        )
        rows: list[Row] = [
            _row(condition, delay_s, "recompute all", recompute, compute, transfer, recompute),
            _row(condition, delay_s, "load all, then compute", t_all, compute, transfer, recompute, copy_s, copied),
        ]
        for p in prefetches:
            t_lw, _, _, wait_s, copy_s, copied = best_of(lambda: rig.ttft_pooled(p, delay_s, False), reps)
            rows.append(
                _row(
                    condition,
                    delay_s,
                    f"layerwise prefetch {p}",
                    t_lw,
                    compute,
                    transfer,
                    recompute,
                    copy_s,
                    copied,
                    wait_s,
                )
            )
        result.rows += rows
        best = min(rows[2:], key=lambda r: r["ttft_ms"])
        key = condition.replace(" ", "_").replace("~", "eq").replace(",", "")
        result.summary[f"{key}.best_layerwise_hidden_fraction"] = best["hidden_fraction"]
        result.summary[f"{key}.load_all_over_best_layerwise_ttft"] = ratio(t_all * 1e3, best["ttft_ms"])
        result.summary[f"{key}.recompute_over_best_layerwise_ttft"] = ratio(recompute * 1e3, best["ttft_ms"])
    return recompute


def _measure(options: BenchOptions, progress: Progress, result: SuiteResult) -> tuple[Rig, Rig]:
    """Every row of the suite (the rigs are closed on return; their shapes remain for the notes)."""
    rig = Rig(options)
    reps = options.reps
    prefetches = (1, 2) if options.tiny else (1, 2, 4)
    try:
        progress.case(f"{NAME} baselines")
        recompute = _conditions(rig, result, progress, reps, prefetches, CONDITIONS)
        _saves(rig, result, progress, reps, recompute)
    finally:
        rig.close()
    deep = Rig(options, deep=True)
    try:
        progress.case(f"{NAME} {deep.model.num_layers} layers")
        _conditions(deep, result, progress, reps, prefetches, CONDITIONS[1:2], tag=f", {deep.model.num_layers} layers")
    finally:
        deep.close()
    return rig, deep


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    import torch

    result = SuiteResult(NAME)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 CPUs: leave one to layerkv's receive thread (see notes)
    try:  # the caller's thread count comes back whatever fails (its compute's bits depend on it)
        rig, deep = _measure(options, progress, result)
    finally:
        torch.set_num_threads(threads)
    result.notes += _notes(rig, deep, options.reps)
    labels = [f"{r['condition']}: {r['variant']}" for r in result.rows]
    result.plots.append(
        bar_plot(
            options.out_dir / "overlap_ttft.png",
            labels,
            {"TTFT ms": [r["ttft_ms"] for r in result.rows]},
            title="TTFT with a 90 % pool hit",
            ylabel="ms",
        )
    )
    return result


def _saves(rig: Rig, result: SuiteResult, progress: Progress, reps: int, recompute: float) -> None:
    """One row and headline per SAVE_VARIANTS: a producer computing the whole prompt into an
    empty pool, against recompute all (`recompute`: the same prompt's TTFT with no pool, s)."""
    progress.case(f"{NAME} saves")
    for key, label, extra in SAVE_VARIANTS:
        saving = best_of(lambda: rig.ttft_saving(extra), reps)
        result.rows.append(
            {
                "condition": "saves (whole prompt computed, every block saved)",
                "delay_ms_per_range_call": 0.0,
                "variant": f"saving, {label}",
                "ttft_ms": saving * 1e3,
                "compute_alone_ms": recompute * 1e3,
                "transfer_alone_ms": float("nan"),
                "hidden_fraction": float("nan"),
                "speedup_vs_recompute": ratio(recompute, saving),
                "staging_copy_ms": 0.0,
                "staging_copy_gb_s": 0.0,
                "compute_wait_ms": float("nan"),
            }
        )
        result.summary[f"saves.{key}_over_no_pool_ttft"] = ratio(saving * 1e3, recompute * 1e3)


def _notes(rig: Rig, deep: Rig, reps: int) -> list[str]:
    """How the suite ran (threads, models, repetitions) and what each column means."""
    return [
        "torch runs with 1 intra-op thread here: with 2 threads on this 2-CPU machine the receive thread's wake-ups "
        "were delayed by hundreds of ms in some runs (TTFT of every pooled variant swung 3-10x).",
        f"model: {rig.model.num_layers} layers, hidden {rig.model.hidden_size}, {rig.prompt_tokens}-token prompt, "
        f"{rig.prefix_tokens} tokens ({HIT_FRACTION:.0%}) in the pool (embedded store), tp 1; best of {reps} fresh "
        "engines per variant (the machine's CPUs are shared; medians swing).",
        f"rows `..., {deep.model.num_layers} layers`: the same with a model of {deep.model.num_layers} layers of "
        "hidden "
        f"{deep.model.hidden_size} (as deep as a real model). A step's first layer can hide only behind the compute "
        f"before layer 0, so at most about 1 - 1/layers of the transfer can be hidden: "
        f"{1 - 1 / rig.model.num_layers:.1%} at {rig.model.num_layers} layers, {1 - 1 / deep.model.num_layers:.1%} at "
        f"{deep.model.num_layers}.",
        "load all, then compute = a WorkerConnector wrapper whose start_load_kv waits for every layer before the "
        "forward starts (prefetch_layers = num_layers); its load time is `transfer alone`. compute alone = the same "
        "suffix computed over a prefix already in the engine's local prefix cache.",
        "hidden_fraction = (transfer alone + compute alone - TTFT) / transfer alone; delays are FaultyStore.delay per "
        "range read, sized from the no-delay transfer time and the number of range calls.",
        "every read lands in the worker's staging area (the defaults: the live cache is never registered with the "
        "store); staging_copy_ms / staging_copy_gb_s = the receive thread's time verifying each staged layer's "
        "tag and copying it into the cache, and the bytes copied over that time (part of transfer alone).",
        "compute_wait_ms (layerwise rows) = the compute thread's time waiting for layers to arrive; what TTFT exceeds "
        "compute alone by beyond it is compute slowed by the transfer's work on the same 2 CPUs, not transfer late.",
        "saves: the whole prompt computed by a producer into an empty pool (every block saved) against the same "
        "prompt with no pool (`recompute all`): what saving costs the compute thread (TTFT includes wait_for_save, "
        "which returns once every layer is copied or written; staged writes then go on in the background).",
    ]


def _row(
    condition: str,
    delay_s: float,
    variant: str,
    ttft_s: float,
    compute_s: float,
    transfer_s: float,
    recompute_s: float,
    copy_s: float = 0.0,
    copied_bytes: int = 0,
    wait_s: float = float("nan"),
) -> Row:
    hidden = (
        (transfer_s + compute_s - ttft_s) / transfer_s
        if variant.startswith("layerwise") and transfer_s > 0
        else float("nan")
    )
    return {
        "condition": condition,
        "delay_ms_per_range_call": delay_s * 1e3,
        "variant": variant,
        "ttft_ms": ttft_s * 1e3,
        "compute_alone_ms": compute_s * 1e3,
        "transfer_alone_ms": transfer_s * 1e3,
        "hidden_fraction": hidden,
        "speedup_vs_recompute": ratio(recompute_s, ttft_s),
        # receive thread: verifying staged layers and copying them out of staging into the cache
        "staging_copy_ms": copy_s * 1e3,
        "staging_copy_gb_s": copied_bytes / copy_s / 1e9 if copy_s > 0 else 0.0,
        # compute thread: waiting for layers (TTFT - compute alone - this: the compute itself ran slower)
        "compute_wait_ms": wait_s * 1e3,
    }
