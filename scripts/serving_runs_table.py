"""Prints the `layerkv bench serving` TTFT table (one row per cell and contender, and the summary
counts) from a runs file: serving_runs.json, or the serving_runs.partial.json a run leaves when
it stops early (its cells are complete up to where it stopped). Usage:
    PYTHONPATH=src .venv/bin/python scripts/serving_runs_table.py \
        bench-results/serving-staging/serving_runs.partial.json
"""

from __future__ import annotations

import json
import sys

from layerkv.bench.serving import report
from layerkv.bench.serving.report import Run


def main(path: str) -> None:
    raw = json.load(open(path))
    raw = raw["runs"] if isinstance(raw, dict) else raw
    runs = [
        Run(**{**r, "cell": tuple(r["cell"]), "token_ids": tuple(r["token_ids"]), "logprobs": tuple(r["logprobs"])})
        for r in raw
    ]
    cells = sorted({r.cell for r in runs if r.repeat >= 0})
    rows, summary = report.suite_rows(runs, cells)
    print(
        "| prefix + new | contender | TTFT median (range) ms | x MooncakeStoreConnector | x bound | bits = "
        "local-cache run |"
    )
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        bits = {True: "yes", False: "NO", None: "-"}[r["bits_equal_local_cache_run"]]
        print(
            f"| {r['prefix_tokens']:,} + {r['suffix_tokens']:,} | {r['contender']} | {r['ttft_ms_median']:,.0f} "
            f"({r['ttft_ms_min']:,.0f}-{r['ttft_ms_max']:,.0f}) | {r['x_mooncake_connector']:.2f} | {r['x_bound']:.2f} "
            f"| {bits} |"
        )
    print()
    for key, value in summary.items():
        if not key.startswith("p"):
            print(f"* {key}: {value:g}")


if __name__ == "__main__":
    main(sys.argv[1])
