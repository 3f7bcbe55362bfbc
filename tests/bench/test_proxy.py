"""Suite proxy in its tiny configuration: the fake servers and the proxy start as processes,
every row is there with finite numbers, the summary subtracts like its notes say, and the
processes are gone after. Times are never asserted (benchmarks are not tests)."""

from __future__ import annotations

import math
from pathlib import Path

from layerkv.bench import OPT_IN_SUITES, SUITE_MODULES, SUITES
from layerkv.bench.common import BenchOptions, Progress
from layerkv.bench.proxy import suite


def test_the_proxy_suite_measures_each_mode_both_ways(tmp_path: Path) -> None:
    assert "proxy" in OPT_IN_SUITES and "proxy" not in SUITES and SUITE_MODULES["proxy"] == suite.__name__
    progress = Progress(1, enabled=False)
    try:
        result = suite.run(BenchOptions(quick=True, out_dir=tmp_path, tiny=True), progress)
    finally:
        progress.close()
    assert [(r["mode"], r["stream"]) for r in result.rows] == [(m, s) for s in (False, True) for m in suite.MODES]
    load = suite.Load.of(BenchOptions(quick=True, out_dir=tmp_path, tiny=True))
    for row in result.rows:
        assert row["requests"] == load.num_requests
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("median_ms", "p99_ms", "requests_per_s"))
        assert row["p99_ms"] >= row["median_ms"]
    by = {(r["mode"], r["stream"]): r for r in result.rows}
    added = by[("proxy", False)]["median_ms"] - by[("decode", False)]["median_ms"]
    assert math.isclose(result.summary["json added_median_ms"], added)
