"""Suite `load`'s report: one row per scenario x contender (throughput, latency percentiles,
failures, pool hits, RSS, idle gauges, put balance, log errors per phase, outputs against no
connector's), the issue's goals checked per row and per scenario, a TTFT percentile plot and an
RSS-over-time plot per scenario. Pure over the records (plus PNG files). Driver thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerkv.bench.common import Row, SuiteResult
from layerkv.bench.load.plan import CONTENDER_TITLES, LAYERKV, NONE, LoadPlan
from layerkv.bench.load.probe import SHUTDOWN_NOISE, PutBalance, Series, rss_slope_pct_per_10min
from layerkv.bench.plots import line_plot, xy_plot


@dataclass(slots=True)
class LoadRecord:
    """One contender's run of one scenario: what the client measured and what the servers,
    the pool and the logs showed."""

    scenario: str
    contender: str
    client: dict[str, Any]  # vLLM's result dict (per-request lists included), or {"error": ...}
    hits_by_source: dict[str, float] = field(default_factory=dict)  # prompt tokens, summed over servers
    external_hit_tokens: float = 0.0  # vllm:external_prefix_cache_hits_total, summed over servers
    layerkv_counters: dict[str, float] = field(default_factory=dict)
    series: dict[str, Series] = field(default_factory=dict)
    load_window_s: tuple[float, float] = (0.0, 0.0)  # the client's run on the sampler's clock
    idle_s_to_zero: float | None = None  # None: a gauge or request count never reached 0
    idle_gauges: dict[str, dict[str, float]] = field(default_factory=dict)  # per server, at the end of idle
    balance_idle: PutBalance | None = None
    balance_stopped: PutBalance | None = None
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    log_errors: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # server -> phase -> lines
    startup_s: float = 0.0


PHASES = ("start", "load", "idle", "stop")
PERCENTS = tuple(range(0, 101, 5))
RSS_GOAL_PCT_PER_10MIN = 1.0


def failed_requests(record: LoadRecord) -> int:
    """The client's failed requests; every request when the client itself failed."""
    if "error" in record.client:
        return int(record.client.get("num_prompts", 0)) or -1
    return int(record.client.get("failed", 0))


def same_outputs(record: LoadRecord, reference: LoadRecord | None) -> tuple[int, int]:
    """(requests whose greedy text equals the reference's, requests both answered): the same
    seed gives both runs the same prompts in the same order."""
    if reference is None or "error" in record.client or "error" in reference.client:
        return 0, 0
    pairs = [
        (a, b)
        for a, b, ea, eb in zip(
            record.client.get("generated_texts", []),
            reference.client.get("generated_texts", []),
            record.client.get("errors", []),
            reference.client.get("errors", []),
        )
        if not ea and not eb
    ]
    return sum(a == b for a, b in pairs), len(pairs)


def peak_rss_mib(record: LoadRecord) -> float:
    """The largest sum over the servers of one sampling round."""
    rounds = zip(*(s.rss_bytes for s in record.series.values())) if record.series else iter(())
    return max((sum(r) for r in rounds), default=0) / (1 << 20)


MIN_SLOPE_WINDOW_S = 120.0  # a shorter window's slope says nothing about a leak


def rss_growth(record: LoadRecord, warmup_fraction: float = 0.25) -> float | None:
    """The worst server's RSS growth (% per 10 min) after the first quarter of the load; None
    when what is left of the load is under MIN_SLOPE_WINDOW_S."""
    start, end = record.load_window_s
    after = start + (end - start) * warmup_fraction
    if end - after < MIN_SLOPE_WINDOW_S:
        return None
    slopes = [
        s for s in (rss_slope_pct_per_10min(series, after, end) for series in record.series.values()) if s is not None
    ]
    return max(slopes, default=None)


def errors_by_phase(record: LoadRecord) -> dict[str, int]:
    """ERROR / CRITICAL lines and tracebacks per phase over the record's servers (vLLM's own
    shutdown noise left out: probe.SHUTDOWN_NOISE)."""
    counts = dict.fromkeys(PHASES, 0)
    for phases in record.log_errors.values():
        for phase, lines in phases.items():
            if phase != SHUTDOWN_NOISE:
                counts[phase] = counts.get(phase, 0) + len(lines)
    return counts


def row(record: LoadRecord, reference: LoadRecord | None) -> Row:
    c = record.client
    same, compared = same_outputs(record, reference)
    prompt_tokens = float(c.get("total_input_tokens", 0) or 0)
    errors = errors_by_phase(record)
    balance = record.balance_stopped
    return {
        "scenario": record.scenario,
        "contender": record.contender,
        "completed": int(c.get("completed", 0)),
        "failed": failed_requests(record),
        "req/s": c.get("request_throughput"),
        "out tok/s": c.get("output_throughput"),
        "TTFT mean ms": c.get("mean_ttft_ms"),
        "TTFT p50 ms": c.get("p50_ttft_ms"),
        "TTFT p99 ms": c.get("p99_ttft_ms"),
        "TPOT mean ms": c.get("mean_tpot_ms"),
        "TPOT p50 ms": c.get("p50_tpot_ms"),
        "TPOT p99 ms": c.get("p99_tpot_ms"),
        "ITL p99 ms": c.get("p99_itl_ms"),
        "pool hit tokens": record.external_hit_tokens,
        "pool hit %": 100 * record.external_hit_tokens / prompt_tokens if prompt_tokens else None,
        "local hit tokens": record.hits_by_source.get("device", 0.0),  # vLLM's own prefix cache
        "peak RSS MiB": peak_rss_mib(record),
        "RSS %/10min": rss_growth(record),
        "idle gauges 0": record.idle_s_to_zero is not None,
        "puts open": balance.open if balance else None,
        "pool keys": balance.key_count if balance else None,
        "evicted keys": balance.evicted_keys if balance else None,
        "ERROR lines start/load/idle/stop": "/".join(str(errors[p]) for p in PHASES),
        "vLLM shutdown noise": sum(len(p.get(SHUTDOWN_NOISE, [])) for p in record.log_errors.values()),
        "same outputs as none": f"{same}/{compared}" if reference is not None and record.contender != NONE else "-",
        "clean exit": all(code == 0 for code in record.exit_codes.values()) if record.exit_codes else False,
    }


def goals(records: Sequence[LoadRecord], rows: Sequence[Row]) -> list[str]:
    """The issue's goals, one line each: reached or missed, with the figures."""
    lines = []
    for r in rows:
        misses = [
            name
            for name, ok in (
                ("failed requests", r["failed"] == 0),
                ("ERROR lines", r["ERROR lines start/load/idle/stop"] == "0/0/0/0"),
                ("puts open", r["puts open"] in (0, None)),
                ("gauges at 0 when idle", r["idle gauges 0"]),
                ("RSS growth <= 1 %/10 min", r["RSS %/10min"] is None or r["RSS %/10min"] <= RSS_GOAL_PCT_PER_10MIN),
                ("clean exit", r["clean exit"]),
            )
            if not ok
        ]
        lines.append(
            f"{r['scenario']} / {r['contender']}: "
            + ("every health goal reached" if not misses else "MISSED " + ", ".join(misses))
        )
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        by = {r["contender"]: r for r in rows if r["scenario"] == scenario}
        if LAYERKV not in by or by[LAYERKV]["req/s"] is None:
            continue
        ours, others = by[LAYERKV], [r for c, r in by.items() if c != LAYERKV and r["req/s"] is not None]
        for other in others:
            verdict = "≥" if ours["req/s"] >= other["req/s"] else "<"
            lines.append(
                f"{scenario}: layerkv {ours['req/s']:.3f} req/s {verdict} {other['contender']} {other['req/s']:.3f}"
            )
        peers = [r for r in others if r["contender"] != NONE and r["TTFT p99 ms"] is not None]
        if peers and ours["TTFT p99 ms"] is not None:
            best = min(peers, key=lambda r: r["TTFT p99 ms"])
            verdict = "≤" if ours["TTFT p99 ms"] <= best["TTFT p99 ms"] else ">"
            lines.append(
                f"{scenario}: layerkv TTFT p99 {ours['TTFT p99 ms']:.0f} ms {verdict} best peer "
                f"({best['contender']}) {best['TTFT p99 ms']:.0f} ms"
            )
    return lines


def _percentiles(values: Sequence[float]) -> list[float]:
    ordered = sorted(values)
    if not ordered:
        return [0.0] * len(PERCENTS)
    return [ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTS]


def plots(records: Sequence[LoadRecord], out_dir: Path) -> list[str]:
    """Per scenario: TTFT by percentile (one line per contender), servers' RSS over time."""
    written = []
    for scenario in dict.fromkeys(r.scenario for r in records):
        mine = [r for r in records if r.scenario == scenario and "error" not in r.client]
        if not mine:
            continue
        ttft = {r.contender: _percentiles([t * 1e3 for t in r.client.get("ttfts", []) if t]) for r in mine}
        written.append(
            line_plot(
                out_dir / f"load-{scenario}-ttft.png",
                list(PERCENTS),
                ttft,
                logy=True,
                title=f"TTFT by percentile ({scenario})",
                xlabel="percentile",
                ylabel="TTFT ms",
            )
        )
        rss = {
            f"{r.contender} {name}": (s.t_s, [b / (1 << 20) for b in s.rss_bytes])
            for r in mine
            for name, s in r.series.items()
        }
        written.append(
            xy_plot(
                out_dir / f"load-{scenario}-rss.png",
                rss,
                title=f"server RSS ({scenario})",
                xlabel="seconds since the servers were ready",
                ylabel="RSS MiB",
            )
        )
    return written


def build(
    plan: LoadPlan, records: Sequence[LoadRecord], out_dir: Path, engine_python: str, with_plots: bool = True
) -> SuiteResult:
    """The suite result: rows, goals as notes, log lines as a table; plots unless `with_plots`
    is False (the engine venv of the real-engine tier has no matplotlib)."""
    references = {r.scenario: r for r in records if r.contender == NONE}
    fallback = next(iter(references.values()), None)  # a prompt's greedy output does not depend on the scenario
    rows = [row(r, references.get(r.scenario, fallback)) for r in records]
    w, m = plan.workload, plan.model
    notes = [
        f"vLLM's benchmark client (vllm.benchmarks.serve, prefix_repetition, seed {w.seed}): {w.num_requests} "
        f"requests, {w.num_prefixes} prefixes x {w.prefix_tokens} tokens + {w.suffix_tokens}-token suffixes, "
        f"{w.output_tokens} output tokens (EOS ignored, greedy), Poisson at {w.request_rate} req/s"
        f"{f', at most {w.max_concurrency} in flight' if w.max_concurrency else ''}; "
        f"engine Python {engine_python}",
        f"model: random-weight Llama {m.num_layers} layers x {m.hidden_size}, {m.dtype}, "
        f"{m.kv_bytes_per_token >> 10} KiB of KV per token",
        "contenders: " + ", ".join(f"{c} = {CONTENDER_TITLES[c]}" for c in dict.fromkeys(r.contender for r in records)),
    ]
    notes += goals(records, rows)
    result = SuiteResult("load", rows=rows, notes=notes, plots=plots(records, out_dir) if with_plots else [])
    result.tables["log lines (ERROR / CRITICAL / tracebacks) per phase"] = _log_rows(records)
    return result


def _log_rows(records: Sequence[LoadRecord]) -> list[Row]:
    out: list[Row] = []
    for r in records:
        for server, phases in r.log_errors.items():
            for phase, lines in phases.items():
                out += [
                    {"scenario": r.scenario, "server": server, "phase": phase, "line": line[:200]} for line in lines[:5]
                ]
    return out
