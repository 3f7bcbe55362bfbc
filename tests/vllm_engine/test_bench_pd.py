"""`layerkv bench pd` (layerkv.bench.pd), smallest grid: one 512-token prefix, a TP=2 prefill
engine, a TP=1 decode engine and a TP=1 engine without a connector on one master. Checks the row
the suite reports: the decode engine loaded every full block the prefill engine wrote (as shards
of another TP size), and every timing was measured. Timings are reported, never asserted."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from layerkv.bench import pd
from layerkv.bench.common import BenchOptions, Progress

pytestmark = pytest.mark.timeout(900)


def test_the_decode_engine_loads_the_prefill_engines_prompt(tmp_path: Path) -> None:
    options = BenchOptions(quick=True, out_dir=tmp_path, engine_python=sys.executable, tiny=True)
    result = pd.run(options, Progress(1, False))
    (row,) = result.rows
    prompt = row["prefix_tokens"] + pd.SUFFIX_TOKENS
    assert row["hit_tokens"] == (prompt - 1) // 32 * 32, row  # every block but the one holding the last token
    for key in ("prefill_ms", "decode_ttft_ms", "pd_ms", "recompute_ttft_ms"):
        assert row[key] is not None and math.isfinite(row[key]) and row[key] > 0, row
    assert (tmp_path / "pd_ttft.png").exists()
    print(row)
