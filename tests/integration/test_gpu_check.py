"""scripts/gpu_check.sh stays runnable where no GPU is: its dry run (LAYERKV_GPU_DEVICE=cpu) runs
the whole GPU tier on this CPU, the connector on its device path (torch copies through pinned
staging, host copies in place of streams), and prints the summary and the TTFT and decode ITL
figures. It
proves the tier's tests and the script, not CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_passes_every_gpu_test_and_reports_ttft_and_decode_itl(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "LAYERKV_GPU_DEVICE": "cpu", "OUT": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    summary = [line for line in lines if line.startswith("gpu_check: pytest exit 0")]
    assert summary and " 13 passed" in summary[0] and "failed" not in summary[0], run.stdout[-2000:]
    reported = [json.loads(line) for line in (tmp_path / "gpu-report.jsonl").read_text().splitlines()]
    ttft, itl = ([f for f in reported if key in f] for key in ("recompute_ms", "itl_none_ms"))
    assert len(ttft) == len(itl) == 1 and all(f["device"] == "cpu" and f["dtype"] == "bfloat16" for f in reported)
    assert all(ttft[0][k] > 0 for k in ("recompute_ms", "local_cache_ms", "pool_ms"))
    assert all(itl[0][k] > 0 for k in ("itl_none_ms", "itl_layerkv_ms"))
    assert sum(line.startswith("gpu_check: figures ") for line in lines) == 2
