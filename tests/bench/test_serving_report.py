"""Suite `serving`'s report without vLLM (layerkv.bench.serving.report): the run order, the
table built from runs (medians, spread, ratios, cache-hit counts, the bound), the correctness
columns, the summary's flags, the load table and the markdown they render. Times are made up
here; nothing is timed. What the suite runs (grid, prompts, CLI, measure): test_serving_grid.py."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

from layerkv.bench.common import BenchOptions, SuiteResult
from layerkv.bench.runner import markdown
from layerkv.bench.serving.grid import Grid
from layerkv.bench.serving.report import (
    CEILING,
    CONTENDERS,
    KEY_CONTENDERS,
    LAYERKV,
    LAYERKV_DIRECT,
    LAYERKV_ENCRYPTED,
    LAYERKV_KEYED,
    MOONCAKE,
    RECOMPUTE,
    LoadRun,
    Run,
    cell_report,
    correctness,
    load_rows,
    percentile,
    schedule,
    suite_rows,
)

CELL = (2048, 32)
TOKENS = (7,)
BITS = ("-0x1.8p-3",)


def _run(
    contender: str,
    repeat: int,
    ttft_ms: float,
    *,
    cell: tuple[int, int] = CELL,
    cached: int | None = None,
    token_ids: tuple[int, ...] = TOKENS,
    logprobs: tuple[str, ...] = BITS,
    reference: bool = False,
) -> Run:
    if cached is None:
        cached = 0 if contender == RECOMPUTE else cell[0]
    return Run(contender, cell, repeat, ttft_ms, cached, token_ids, logprobs, reference)


def _cell_runs(cell: tuple[int, int] = CELL) -> list[Run]:
    """3 repeats; recompute 1000-1200 ms, ceiling 40-60, layerkv 110-130, layerkv register_kv_cache 90,
    Mooncake 60-80, and each connector's local-cache reference run (same bits)."""
    runs = []
    for r in range(3):
        runs += [
            _run(RECOMPUTE, r, 1000 + 100 * r, cell=cell, logprobs=("-0x1.9p-3",)),  # other numerics: no connector
            _run(CEILING, r, 60 - 10 * r, cell=cell),
            _run(LAYERKV, r, 110 + 10 * r, cell=cell),
            _run(LAYERKV_DIRECT, r, 90, cell=cell),
            _run(MOONCAKE, r, 80 - 10 * r, cell=cell),
            _run(LAYERKV, r, 45, cell=cell, reference=True),
            _run(MOONCAKE, r, 45, cell=cell, reference=True),
        ]
    return runs


def _rows(runs: list[Run]) -> dict[str, dict]:
    return {row["contender"]: row for row in cell_report(runs, CELL).rows}


def test_schedule_runs_every_contender_once_per_cell_and_repeat_and_rotates_the_order() -> None:
    steps = schedule((512, 2048), (32, 512), 3)
    assert len(steps) == 4 * 3
    assert Counter((s.cell, s.repeat) for s in steps) == {
        ((p, s), r): 1 for p in (512, 2048) for s in (32, 512) for r in range(3)
    }
    assert [s.repeat for s in steps] == [0] * 4 + [1] * 4 + [2] * 4  # repeats outermost
    for step in steps:
        assert sorted(step.contenders) == sorted(CONTENDERS)
    firsts = Counter(s.contenders[0] for s in steps)
    assert set(firsts) == set(CONTENDERS) and max(firsts.values()) - min(firsts.values()) <= 1
    cell_firsts = {s.contenders[0] for s in steps if s.cell == (512, 32)}
    assert len(cell_firsts) == 3  # one cell's repeats start with different contenders


def test_rows_hold_median_spread_and_ratios_of_medians() -> None:
    rows = _rows(_cell_runs())
    assert list(rows) == list(CONTENDERS)
    lk, mc = rows[LAYERKV], rows[MOONCAKE]
    assert (lk["ttft_ms_median"], lk["ttft_ms_min"], lk["ttft_ms_max"], lk["runs"]) == (120, 110, 130, 3)
    assert (mc["ttft_ms_median"], mc["ttft_ms_min"], mc["ttft_ms_max"]) == (70, 60, 80)
    assert lk["x_mooncake_connector"] == pytest.approx(120 / 70)
    assert lk["x_ceiling"] == pytest.approx(120 / 50)
    assert lk["x_recompute"] == pytest.approx(120 / 1100)
    assert rows[RECOMPUTE]["x_recompute"] == pytest.approx(1.0)
    summary = cell_report(_cell_runs(), CELL).summary
    assert summary["p2048 s32 layerkv / MooncakeStoreConnector"] == pytest.approx(120 / 70)
    assert summary["p2048 s32 MooncakeStoreConnector / vLLM local prefix cache"] == pytest.approx(70 / 50)
    assert summary["p2048 s32 layerkv register_kv_cache / MooncakeStoreConnector"] == pytest.approx(90 / 70)


def test_reference_runs_are_not_timed_rows() -> None:
    runs = _cell_runs() + [_run(LAYERKV, 0, 1e6, reference=True)]
    assert _rows(runs)[LAYERKV]["ttft_ms_max"] == 130


def test_cache_hits_are_counted_against_what_each_contender_must_get() -> None:
    runs = _cell_runs()
    runs[2] = _run(LAYERKV, 0, 900, cached=0)  # a pool miss: recomputed, its time stays in
    runs[0] = _run(RECOMPUTE, 0, 1000, cached=2048)  # recompute that hit a cache
    rows = _rows(runs)
    assert rows[LAYERKV]["runs_cache_as_expected"] == 2 and rows[LAYERKV]["ttft_ms_max"] == 900
    assert rows[RECOMPUTE]["runs_cache_as_expected"] == 2
    assert rows[MOONCAKE]["runs_cache_as_expected"] == 3 and rows[CEILING]["runs_cache_as_expected"] == 3


def test_correctness_tokens_against_recompute_bits_against_the_connectors_local_run() -> None:
    runs = _cell_runs()
    assert correctness(runs, LAYERKV, CELL) == (True, True)  # recompute's logprob bits differ: not compared
    assert correctness(runs, CEILING, CELL) == (True, None)
    assert correctness(runs, RECOMPUTE, CELL) == (None, None)
    other_token = [
        _run(MOONCAKE, 1, 70, token_ids=(8,)) if (r.contender, r.repeat, r.reference) == (MOONCAKE, 1, False) else r
        for r in runs
    ]
    assert correctness(other_token, MOONCAKE, CELL) == (False, False)
    other_bits = [
        _run(LAYERKV, 2, 45, logprobs=("-0x1.8000000000001p-3",), reference=True)
        if (r.contender, r.repeat, r.reference) == (LAYERKV, 2, True)
        else r
        for r in runs
    ]
    assert correctness(other_bits, LAYERKV, CELL) == (True, False)
    assert correctness(other_bits, LAYERKV_DIRECT, CELL) == (True, False)  # same producer, same reference
    assert correctness(other_bits, MOONCAKE, CELL) == (True, True)


def test_bits_are_not_compared_when_a_reference_was_not_served_from_the_local_cache() -> None:
    runs = [
        _run(LAYERKV, 1, 45, cached=0, reference=True)
        if (r.contender, r.repeat, r.reference) == (LAYERKV, 1, True)
        else r
        for r in _cell_runs()
    ]
    assert correctness(runs, LAYERKV, CELL) == (True, None)
    missing = [r for r in _cell_runs() if not (r.contender == MOONCAKE and r.reference and r.repeat == 0)]
    assert correctness(missing, MOONCAKE, CELL) == (True, None)
    no_recompute = [r for r in _cell_runs() if not (r.contender == RECOMPUTE and r.repeat == 2)]
    assert correctness(no_recompute, LAYERKV, CELL)[0] is None


def test_suite_summary_flags_and_wins() -> None:
    cells = [CELL, (512, 512)]
    fast = [
        _run(c, r.repeat, r.ttft_ms / 10 if c == LAYERKV else r.ttft_ms, cell=(512, 512), reference=r.reference)
        for r in _cell_runs((512, 512))
        for c in [r.contender]
    ]
    rows, summary = suite_rows(_cell_runs() + fast, cells)
    assert [(r["prefix_tokens"], r["suffix_tokens"]) for r in rows] == [CELL] * 5 + [(512, 512)] * 5
    assert summary["cells where layerkv beats MooncakeStoreConnector"] == 1.0 and summary["cells"] == 2.0
    assert summary["cells where layerkv or layerkv register_kv_cache beats MooncakeStoreConnector"] == 1.0
    assert summary["all tokens equal recompute"] == 1.0
    assert summary["all pool runs bit-identical to local-cache runs"] == 1.0
    assert summary["all runs hit the cache as expected"] == 1.0
    broken = [
        _run(LAYERKV, 0, 120, token_ids=(9,)) if (r.contender, r.repeat, r.reference) == (LAYERKV, 0, False) else r
        for r in _cell_runs()
    ]
    _, summary = suite_rows(broken, [CELL])
    assert summary["all tokens equal recompute"] == 0.0
    assert summary["all pool runs bit-identical to local-cache runs"] == 0.0
    _, summary = suite_rows([r for r in _cell_runs() if not r.reference], [CELL])
    assert summary["all pool runs bit-identical to local-cache runs"] == 0.0  # nothing compared is not a pass
    _, summary = suite_rows([r for r in _cell_runs() if r.contender in (RECOMPUTE, CEILING)], [CELL])
    assert summary["all pool runs bit-identical to local-cache runs"] == 0.0  # no pool run at all
    tie = [
        _run(LAYERKV, r.repeat, 80 - 10 * r.repeat) if (r.contender, r.reference) == (LAYERKV, False) else r
        for r in _cell_runs()
    ]
    _, summary = suite_rows(tie, [CELL])
    assert summary["p2048 s32 layerkv / MooncakeStoreConnector"] == 1.0
    assert summary["cells where layerkv beats MooncakeStoreConnector"] == 0.0  # a tie is no win
    grouped = [
        _run(LAYERKV_DIRECT, r.repeat, 50) if (r.contender, r.reference) == (LAYERKV_DIRECT, False) else r for r in tie
    ]
    _, summary = suite_rows(grouped, [CELL])
    assert summary["cells where layerkv beats MooncakeStoreConnector"] == 0.0
    assert summary["cells where layerkv or layerkv register_kv_cache beats MooncakeStoreConnector"] == 1.0


def test_tenant_keys_grid_sets_a_key_and_encryption_beside_no_key(tmp_path: Path) -> None:
    """--tenant-keys: three layerkv contenders, each with its own producer, no peers; the cost of
    a key is each keyed contender's median over no key's, and its bits are checked against its
    own producer."""
    grid = Grid.for_options(BenchOptions(quick=True, out_dir=tmp_path, tenant_keys=True))
    assert grid.contenders == KEY_CONTENDERS and grid.load_repeats == 0 and grid.repeats == 1
    assert grid.engines == (
        "layerkv-producer",
        "layerkv",
        "layerkv-keyed-producer",
        "layerkv-keyed",
        "layerkv-encrypted-producer",
        "layerkv-encrypted",
    )
    assert grid.num_producers == 3 and Grid.for_options(BenchOptions(quick=True, out_dir=tmp_path)).num_producers == 2
    runs = []
    for r in range(3):
        runs += [
            _run(LAYERKV, r, 100 + r),
            _run(LAYERKV_KEYED, r, 104 + r),
            _run(LAYERKV_ENCRYPTED, r, 110 + r),
            *(_run(c, r, 45, reference=True) for c in KEY_CONTENDERS),
        ]
    rows, summary = suite_rows(runs, [CELL])
    assert [r["contender"] for r in rows] == list(KEY_CONTENDERS)
    assert summary["p2048 s32 layerkv tenant key / layerkv"] == pytest.approx(105 / 101)
    assert summary["p2048 s32 layerkv encrypted / layerkv"] == pytest.approx(111 / 101)
    assert summary["all pool runs bit-identical to local-cache runs"] == 1.0
    assert not any(
        "MooncakeStoreConnector" in k or "recompute" in k for k in summary
    )  # no peers ran: no flags about them
    assert all(math.isnan(r["x_bound"]) for r in rows)  # no ceiling: no bound
    wrong = [
        _run(LAYERKV_ENCRYPTED, r.repeat, 45, token_ids=(8,), reference=True)
        if (r.contender, r.reference) == (LAYERKV_ENCRYPTED, True)
        else r
        for r in runs
    ]
    assert suite_rows(wrong, [CELL])[1]["all pool runs bit-identical to local-cache runs"] == 0.0


def test_results_render_as_markdown_and_json(tmp_path: Path) -> None:
    result = SuiteResult("serving", notes=["how"])
    result.rows, result.summary = suite_rows(_cell_runs(), [CELL])
    doc = {
        "command": "layerkv bench serving --quick",
        "machine": {"cpus": 2, "python": "3.11", "platform": "linux"},
        "total_seconds": 1.0,
        "suites": {"serving": asdict(result)},
    }
    md = markdown(json.loads(json.dumps(doc)))
    assert "| prefix_tokens | suffix_tokens | contender | ttft_ms_median |" in md
    assert "| 2048 | 32 | layerkv | 120 | 110 | 130 | 3 | 3 |" in md
    assert "| p2048 s32 layerkv / MooncakeStoreConnector | 1.71 |" in md


def _load(
    contender: str,
    repeat: int,
    wall_ms: float,
    ttft_ms: tuple[float, ...],
    tokens: tuple[tuple[int, ...], ...] = ((1, 2), (3, 4)),
    cached: tuple[int, ...] = (0, 2048),
) -> LoadRun:
    return LoadRun(contender, repeat, wall_ms, 2, ttft_ms, cached, tokens)


def test_percentile_is_nearest_rank() -> None:
    assert percentile(list(range(1, 11)), 90) == 9 and percentile(list(range(1, 21)), 90) == 18
    assert percentile([5.0], 90) == 5.0 and percentile([3, 1, 2], 100) == 3


def test_load_rows_rates_ttft_and_tokens_against_recompute() -> None:
    runs = [
        _load(RECOMPUTE, 0, 4000, (100, 300)),
        _load(RECOMPUTE, 1, 2000, (200, 400)),
        _load(LAYERKV, 0, 1000, (10, 30)),
        _load(LAYERKV, 1, 3000, (20, 40), tokens=((1, 2), (3, 5))),
        _load(LAYERKV, 2, 9000, (50, 60)),  # no recompute run of repeat 2: its tokens are not compared
        _load(MOONCAKE, 0, 500, (5, 7), cached=(2048, 2048)),
    ]
    rows = {r["contender"]: r for r in load_rows(runs)}
    assert list(rows) == [RECOMPUTE, LAYERKV, MOONCAKE]  # contenders that ran, in CONTENDERS order
    lk = rows[LAYERKV]
    assert (lk["requests"], lk["repeats"], lk["batch_ms_median"]) == (2, 3, 3000)
    assert lk["requests_per_s"] == pytest.approx(2 / 3) and lk["tokens_per_s"] == pytest.approx(4 / 3)
    assert lk["ttft_ms_mean"] == pytest.approx(35) and lk["ttft_ms_p90"] == 60
    assert (lk["requests_tokens_equal_recompute"], lk["requests_compared"]) == (3, 4)
    assert lk["requests_with_cache_hit"] == 3
    assert rows[MOONCAKE]["requests_with_cache_hit"] == 2 and rows[MOONCAKE]["requests_compared"] == 2
    assert rows[RECOMPUTE]["requests_tokens_equal_recompute"] is None
    assert lk["requests_tokens_equal_ceiling"] == 0  # no ceiling run: nothing compared
    with_ceiling = runs + [_load(CEILING, 1, 800, (5, 6), tokens=((1, 2), (3, 4)))]
    rows = {r["contender"]: r for r in load_rows(with_ceiling)}
    assert rows[LAYERKV]["requests_tokens_equal_ceiling"] == 1  # repeat 1: (1, 2) equal, (3, 5) not
    assert (
        rows[RECOMPUTE]["requests_tokens_equal_ceiling"] == 2 and rows[CEILING]["requests_tokens_equal_ceiling"] is None
    )


def test_extra_tables_render_under_their_title() -> None:
    result = SuiteResult("serving")
    result.tables["Throughput under load"] = load_rows([_load(RECOMPUTE, 0, 4000, (100, 300))])
    doc = {
        "command": "",
        "machine": {"cpus": 2, "python": "3.11", "platform": "linux"},
        "total_seconds": 1.0,
        "suites": {"serving": asdict(result)},
    }
    md = markdown(doc)
    assert "### Throughput under load\n\n| contender | requests | repeats | batch_ms_median |" in md
    assert "| recompute | 2 | 1 | 4000 | 0.5 | 1.00 | 200 | 300 | 1 | - | - | 0 |" in md


def test_the_bound_is_the_ceiling_or_the_transfer_alone_whichever_is_slower() -> None:
    """x_bound = TTFT / max(ceiling, transfer alone); the transfer row has no correctness to
    compare; the summary counts the cells within 1.25x the bound and within 1.1x of
    register_kv_cache."""
    from layerkv.bench.serving.report import TRANSFER, suite_rows

    transfer = [Run(TRANSFER, CELL, r, 80.0 + r, CELL[0], (), ()) for r in range(3)]  # median 81 > ceiling 50
    rows = _rows(_cell_runs() + transfer)
    assert rows[TRANSFER]["ttft_ms_median"] == 81.0
    assert rows[TRANSFER]["tokens_equal_recompute"] is None and rows[TRANSFER]["bits_equal_local_cache_run"] is None
    assert rows[LAYERKV]["x_bound"] == pytest.approx(120 / 81)
    assert rows[MOONCAKE]["x_bound"] == pytest.approx(70 / 81)
    assert _rows(_cell_runs())[LAYERKV]["x_bound"] == pytest.approx(120 / 50)  # no transfer measured: the ceiling
    _, summary = suite_rows(_cell_runs() + transfer, [CELL])
    assert summary["p2048 s32 layerkv / bound"] == pytest.approx(120 / 81)
    assert summary["cells where layerkv <= 1.25x the bound"] == 0.0  # 1.48x
    assert summary["cells where layerkv <= 1.1x layerkv register_kv_cache"] == 0.0  # 120 / 90
    assert summary["all tokens equal recompute"] == 1.0  # the transfer row is not compared
