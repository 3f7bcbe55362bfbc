"""`layerkv bench pd` (layerkv.bench.serving.pd), smallest grid: one 512-token prefix, a TP=2 prefill
engine, a TP=1 decode engine and a TP=1 engine without a connector on one master. Checks the row
the suite reports: the decode engine loaded every full block the prefill engine wrote (as shards
of another TP size), and every timing was measured (the plots are the driver's: .venv has matplotlib). Timings are
reported, never asserted."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from layerkv.bench.common import BenchOptions, Progress
from layerkv.bench.serving import pd

pytestmark = pytest.mark.timeout(900)


def test_the_decode_engine_loads_the_prefill_engines_prompt(tmp_path: Path) -> None:
    options = BenchOptions(quick=True, out_dir=tmp_path, engine_python=sys.executable, tiny=True)
    rows, about = pd.measure(sys.executable, pd.grid(options), Progress(1, False))
    (row,) = rows
    prompt = row["prefix_tokens"] + pd.SUFFIX_TOKENS
    assert row["hit_tokens"] == (prompt - 1) // 32 * 32, row  # every block but the one holding the last token
    assert row["settled_hit_tokens"] == row["hit_tokens"], row
    for key in ("prefill_ms", "decode_ttft_ms", "pd_ms", "decode_settled_ttft_ms", "recompute_ttft_ms"):
        assert row[key] is not None and math.isfinite(row[key]) and row[key] > 0, row
    assert set(about["startup_s"]) == {"prefill", "decode", "plain"}
    print(row)
