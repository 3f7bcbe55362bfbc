"""Pure logic of suite `serving`: the order in which contenders run, and the table built from the
runs (medians, spread, ratios side by side, the correctness columns). No engine, no I/O: the
suite (layerkv.bench.serving.suite) feeds it `Run`s. Driver thread only.

Correctness: a pool contender's first token must equal recompute's (same prompt), and its
token and logprob bits must equal the same connector's run served from vLLM's local prefix
cache (the producer engine, same schedule: prefix cached, suffix computed). Logprobs are not
compared with recompute: a connector changes the CPU numerics of a run (what layerkv's
real-engine tier found), so a connector run is compared with a connector run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from layerkv.bench.common import Row, ratio

RECOMPUTE = "recompute"
CEILING = "vLLM local prefix cache"
LAYERKV = "layerkv"
LAYERKV_DIRECT = "layerkv register_kv_cache"  # the live cache registered: direct per-layer plans allowed
MOONCAKE = "MooncakeStoreConnector"
CONTENDERS: tuple[str, ...] = (RECOMPUTE, CEILING, LAYERKV, LAYERKV_DIRECT, MOONCAKE)
# `--tenant-keys`: layerkv's defaults with a tenant key (keyed names and MACs) and with encrypt_objects
LAYERKV_KEYED = "layerkv tenant key"
LAYERKV_ENCRYPTED = "layerkv encrypted"
KEY_CONTENDERS: tuple[str, ...] = (LAYERKV, LAYERKV_KEYED, LAYERKV_ENCRYPTED)
ALL_CONTENDERS: tuple[str, ...] = (*CONTENDERS, LAYERKV_KEYED, LAYERKV_ENCRYPTED)
POOL_CONTENDERS: tuple[str, ...] = (LAYERKV, LAYERKV_DIRECT, MOONCAKE, LAYERKV_KEYED, LAYERKV_ENCRYPTED)
# whose local-cache reference run a pool contender's bits are compared with: its connector's producer
# (keyed contenders have producers with the same key: nobody else's objects verify)
REFERENCE_OF = {
    LAYERKV: LAYERKV,
    LAYERKV_DIRECT: LAYERKV,
    MOONCAKE: MOONCAKE,
    LAYERKV_KEYED: LAYERKV_KEYED,
    LAYERKV_ENCRYPTED: LAYERKV_ENCRYPTED,
}
# not an engine: a bare client reading the prefix's layerkv objects whole into memory, no compute
TRANSFER = "transfer alone"
Cell = tuple[int, int]  # (prefix tokens, suffix tokens)


@dataclass(frozen=True, slots=True)
class Run:
    """One timed request (max_tokens=1) of one contender, or a reference run (`reference`:
    the connector's producer engine serving the prefix from its local cache)."""

    contender: str
    cell: Cell
    repeat: int
    ttft_ms: float
    cached_tokens: int  # vLLM's num_cached_tokens: local + pool hits
    token_ids: tuple[int, ...]
    logprobs: tuple[str, ...]  # float.hex() of each chosen token's logprob
    reference: bool = False
    engine_ttft_ms: float | None = None  # vLLM's own arrival -> first token (RequestStateStats)


@dataclass(frozen=True, slots=True)
class Step:
    """What the suite does next: measure `contenders` (in this order) for one cell and repeat."""

    cell: Cell
    repeat: int
    contenders: tuple[str, ...]


def schedule(
    prefixes: Sequence[int], suffixes: Sequence[int], repeats: int, contenders: Sequence[str] = CONTENDERS
) -> list[Step]:
    """Repeats outermost (each cell's repeats spread over the whole run), every contender of a
    cell back to back, their order rotated by one per repeat and cell, so that slow phases of
    this shared machine hit every contender alike and none is always first."""
    steps = []
    for r in range(repeats):
        for i, cell in enumerate((p, s) for p in prefixes for s in suffixes):
            k = (r + i) % len(contenders)
            steps.append(Step(cell, r, tuple(contenders[k:]) + tuple(contenders[:k])))
    return steps


def expected_cached_tokens(contender: str, prefix_tokens: int) -> int:
    """What vLLM must report as cached: nothing for recompute, the whole prefix otherwise (the
    ceiling from its local cache, pool contenders from the pool, references locally)."""
    return 0 if contender == RECOMPUTE else prefix_tokens


@dataclass(slots=True)
class CellReport:
    """Rows of one cell, one per contender, plus its headline ratios."""

    rows: list[Row] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)


def _same_bits(a: Run, b: Run) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def correctness(runs: Sequence[Run], contender: str, cell: Cell) -> tuple[bool | None, bool | None]:
    """(tokens equal recompute's, tokens + logprobs bit-identical to the connector's local-cache
    reference) over the repeats of `cell`; None where there is nothing to compare (recompute
    itself; no reference for a non-pool contender; a repeat whose runs are missing, or whose
    reference was not served from the local cache: its schedule differs)."""
    mine = {r.repeat: r for r in runs if r.contender == contender and r.cell == cell and not r.reference}
    if contender in (RECOMPUTE, TRANSFER) or not mine:
        return None, None
    recompute = {r.repeat: r for r in runs if r.contender == RECOMPUTE and r.cell == cell and not r.reference}
    tokens_equal: bool | None = None
    if set(mine) <= set(recompute):
        tokens_equal = all(mine[k].token_ids == recompute[k].token_ids for k in mine)
    if contender not in POOL_CONTENDERS:
        return tokens_equal, None
    refs = {r.repeat: r for r in runs if r.contender == REFERENCE_OF[contender] and r.cell == cell and r.reference}
    if not set(mine) <= set(refs) or any(refs[k].cached_tokens != cell[0] for k in mine):
        return tokens_equal, None
    return tokens_equal, all(_same_bits(mine[k], refs[k]) for k in mine)


def cell_report(runs: Sequence[Run], cell: Cell) -> CellReport:
    """One row per contender that ran in `cell` (and one for the transfer alone): median / min /
    max TTFT, how many runs hit the cache as expected, ratios of medians against recompute, the
    ceiling, MooncakeStoreConnector and the bound max(ceiling, transfer alone), and the
    correctness columns. Summary: the same ratios keyed `p{prefix} s{suffix} a/b`."""
    timed = [r for r in runs if r.cell == cell and not r.reference]
    medians = {
        c: statistics.median(r.ttft_ms for r in timed if r.contender == c)
        for c in (*ALL_CONTENDERS, TRANSFER)
        if any(r.contender == c for r in timed)
    }
    # without the ceiling (the --tenant-keys grid) there is no bound to report
    bound = max(medians[CEILING], medians.get(TRANSFER, 0.0)) if CEILING in medians else 0.0
    report = CellReport()
    for contender, median_ms in medians.items():
        mine = [r for r in timed if r.contender == contender]
        tokens_equal, bits_equal = correctness(runs, contender, cell)
        expected = expected_cached_tokens(contender, cell[0])
        report.rows.append(
            {
                "prefix_tokens": cell[0],
                "suffix_tokens": cell[1],
                "contender": contender,
                "ttft_ms_median": median_ms,
                "ttft_ms_min": min(r.ttft_ms for r in mine),
                "ttft_ms_max": max(r.ttft_ms for r in mine),
                "runs": len(mine),
                "runs_cache_as_expected": sum(r.cached_tokens == expected for r in mine),
                "x_recompute": ratio(median_ms, medians.get(RECOMPUTE, 0.0)),
                "x_ceiling": ratio(median_ms, medians.get(CEILING, 0.0)),
                "x_mooncake_connector": ratio(median_ms, medians.get(MOONCAKE, 0.0)),
                "x_bound": ratio(median_ms, bound),
                "tokens_equal_recompute": tokens_equal,
                "bits_equal_local_cache_run": bits_equal,
            }
        )
    tag = f"p{cell[0]} s{cell[1]}"
    for num, den in (
        (LAYERKV, MOONCAKE),
        (LAYERKV_DIRECT, MOONCAKE),
        (LAYERKV, LAYERKV_DIRECT),
        (LAYERKV, CEILING),
        (LAYERKV_DIRECT, CEILING),
        (MOONCAKE, CEILING),
        (LAYERKV, RECOMPUTE),
        (MOONCAKE, RECOMPUTE),
        (LAYERKV_KEYED, LAYERKV),
        (LAYERKV_ENCRYPTED, LAYERKV),
    ):
        if num in medians and den in medians:
            report.summary[f"{tag} {num} / {den}"] = ratio(medians[num], medians[den])
    if bound > 0:
        for contender in POOL_CONTENDERS:
            if contender in medians:
                report.summary[f"{tag} {contender} / bound"] = ratio(medians[contender], bound)
    return report


def suite_rows(runs: Sequence[Run], cells: Sequence[Cell]) -> tuple[list[Row], dict[str, float]]:
    """Every cell's rows and summary, plus overall flags: 1.0 / 0.0 whether every compared
    token and logprob matched (a missing comparison counts as not matched); in how many cells
    layerkv's median TTFT (defaults; and with either setting) was below MooncakeStoreConnector's;
    in how many the defaults were within 10 % of register_kv_cache where that was faster, and
    within 1.25x the bound max(ceiling, transfer alone)."""
    rows: list[Row] = []
    summary: dict[str, float] = {}
    wins = best_wins = near_direct = near_bound = 0
    for cell in cells:
        report = cell_report(runs, cell)
        rows += report.rows
        summary.update(report.summary)
        tag = f"p{cell[0]} s{cell[1]}"
        mine = [report.summary.get(f"{tag} {c} / {MOONCAKE}", float("inf")) for c in (LAYERKV, LAYERKV_DIRECT)]
        wins += mine[0] < 1.0
        best_wins += min(mine) < 1.0
        near_direct += report.summary.get(f"{tag} {LAYERKV} / {LAYERKV_DIRECT}", float("inf")) <= 1.1
        near_bound += report.summary.get(f"{tag} {LAYERKV} / bound", float("inf")) <= 1.25
    pool_rows = [r for r in rows if r["contender"] in POOL_CONTENDERS]
    ran = {r["contender"] for r in rows}
    if RECOMPUTE in ran:
        summary["all tokens equal recompute"] = float(
            all(r["tokens_equal_recompute"] is True for r in rows if r["contender"] not in (RECOMPUTE, TRANSFER))
        )
    summary["all pool runs bit-identical to local-cache runs"] = float(
        bool(pool_rows) and all(r["bits_equal_local_cache_run"] is True for r in pool_rows)
    )
    summary["all runs hit the cache as expected"] = float(all(r["runs_cache_as_expected"] == r["runs"] for r in rows))
    if MOONCAKE in ran:
        summary[f"cells where {LAYERKV} beats {MOONCAKE}"] = float(wins)
        summary[f"cells where {LAYERKV} or {LAYERKV_DIRECT} beats {MOONCAKE}"] = float(best_wins)
        summary[f"cells where {LAYERKV} <= 1.1x {LAYERKV_DIRECT}"] = float(near_direct)
        summary[f"cells where {LAYERKV} <= 1.25x the bound"] = float(near_bound)
    summary["cells"] = float(len(cells))
    return rows, summary


@dataclass(frozen=True, slots=True)
class LoadRun:
    """One batch of concurrent requests (all submitted at once) served by one contender."""

    contender: str
    repeat: int
    wall_ms: float
    max_tokens: int
    ttft_ms: tuple[float, ...]  # per request: vLLM's arrival -> first token
    cached_tokens: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]


def percentile(values: Sequence[float], q: int) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))] if ordered else float("nan")


def load_rows(runs: Sequence[LoadRun]) -> list[Row]:
    """One row per contender: median batch wall time over repeats, requests/s and generated
    tokens/s from it, mean / p90 TTFT over every request of every repeat, requests that hit a
    cache, requests whose tokens equal recompute's and the local-prefix-cache ceiling's (same
    repeat, same request). Under batching the tokens of a request whose prefix was cached and
    of one whose prefix was computed may differ (vLLM's numerics; every cached contender
    alike), so the ceiling is the comparison for pool hits."""
    recompute = {r.repeat: r for r in runs if r.contender == RECOMPUTE}
    ceiling = {r.repeat: r for r in runs if r.contender == CEILING}
    rows: list[Row] = []
    for contender in ALL_CONTENDERS:
        mine = [r for r in runs if r.contender == contender]
        if not mine:
            continue
        wall_ms = statistics.median(r.wall_ms for r in mine)
        num_requests = len(mine[0].token_ids)
        ttfts = [t for r in mine for t in r.ttft_ms]
        compared = [
            (a, b) for r in mine if r.repeat in recompute for a, b in zip(r.token_ids, recompute[r.repeat].token_ids)
        ]
        vs_ceiling = [
            (a, b) for r in mine if r.repeat in ceiling for a, b in zip(r.token_ids, ceiling[r.repeat].token_ids)
        ]
        rows.append(
            {
                "contender": contender,
                "requests": num_requests,
                "repeats": len(mine),
                "batch_ms_median": wall_ms,
                "requests_per_s": num_requests / wall_ms * 1000,
                "tokens_per_s": num_requests * mine[0].max_tokens / wall_ms * 1000,
                "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
                "ttft_ms_p90": percentile(ttfts, 90),
                "requests_with_cache_hit": sum(c > 0 for r in mine for c in r.cached_tokens),
                "requests_tokens_equal_recompute": sum(a == b for a, b in compared) if contender != RECOMPUTE else None,
                "requests_compared": len(compared) if contender != RECOMPUTE else None,
                "requests_tokens_equal_ceiling": sum(a == b for a, b in vs_ceiling) if contender != CEILING else None,
            }
        )
    return rows


def counters_text(values: dict[str, Any]) -> str:
    """`vllm:layerkv_total{counter=load_blocks}` -> `load_blocks`, Mooncake's
    `vllm:mooncake_store_operation_keys_total{operation=get,status=ok}` -> `operation_keys{get,ok}`."""
    if "error" in values:
        return f"unavailable ({values['error']})"
    shown = []
    for key, value in sorted(values.items()):
        name, _, labels = key.partition("{")
        labels = labels.rstrip("}")
        if name.startswith("vllm:layerkv"):
            label = labels.removeprefix("counter=")
        else:
            label = (
                name.removeprefix("vllm:mooncake_store_").removesuffix("_total")
                + "{"
                + ",".join(part.partition("=")[2] for part in labels.split(",") if part)
                + "}"
            )
        if value:
            shown.append(f"{label}={value:g}")
    return ", ".join(shown) or "none"
