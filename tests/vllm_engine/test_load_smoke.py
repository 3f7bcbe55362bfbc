"""The load smoke of `layerkv bench load` (issue 44), through the suite's own code path
(layerkv.bench.load.suite.run_plan + layerkv.bench.load.report.build): vLLM's benchmark client sends 24 greedy
requests over 8 shared prefixes (Poisson, 6 req/s) to one `vllm serve` without a connector,
then to two layerkv servers sharing one `layerkv master` pool (round robin: a prefix computed by
one server is loaded by the other), each server's local KV cache a quarter of the prefixes.

Checked: every request answered; the pool served prompt tokens; no ERROR line or traceback in
any server's log from start to stop; layerkv's gauges and vLLM's request counts back to 0 when
idle; every put the master started was ended or revoked; servers exit 0; every request's greedy
text equals the no-connector server's for the same prompt (same seed, same prompts in the same
order; the tiny model's sharpened output head keeps greedy tokens stable across schedules).
"""

from __future__ import annotations

import sys

import pytest

from layerkv.bench.common import BenchOptions, Progress
from layerkv.bench.load.plan import CAPACITY, LAYERKV, NONE, TWO_SERVERS, LoadPlan
from layerkv.bench.load.report import build, errors_by_phase, same_outputs
from layerkv.bench.load.suite import run_plan
from tests.vllm_engine.tier import TIER_BOUNDS

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    plan = LoadPlan.build(tiny=True)
    options = BenchOptions(
        quick=False, out_dir=tmp_path_factory.mktemp("load-smoke"), tiny=True, engine_python=sys.executable
    )
    progress = Progress(1, enabled=False)
    # the tier's engines start beside this test: layerkv's time bounds widened as for them (tier.py)
    records = run_plan(
        plan, options, progress, layerkv_extra=TIER_BOUNDS, runs=[(CAPACITY, NONE), (TWO_SERVERS, LAYERKV)]
    )
    progress.close()
    return plan, records, build(plan, records, options.out_dir, sys.executable, with_plots=False)


def test_every_request_is_answered_and_the_pool_serves_prompt_tokens(smoke):
    plan, records, result = smoke
    for record in records:
        assert "error" not in record.client, record.client.get("error")
        assert record.client["completed"] == plan.workload.num_requests, record.client
        assert record.client["failed"] == 0 and not any(record.client["errors"])
    layerkv = records[1]
    assert layerkv.external_hit_tokens >= plan.workload.prefix_tokens, layerkv.hits_by_source
    assert layerkv.layerkv_counters.get("load_blocks", 0) > 0 and layerkv.layerkv_counters.get("committed_keys", 0) > 0
    print("\n" + "\n".join(result.notes))


def test_no_error_line_in_any_phase_and_clean_exits(smoke):
    _, records, _ = smoke
    for record in records:
        assert errors_by_phase(record) == {"start": 0, "load": 0, "idle": 0, "stop": 0}, record.log_errors
        assert record.exit_codes and all(code == 0 for code in record.exit_codes.values()), record.exit_codes


def test_gauges_return_to_zero_and_every_put_is_ended_or_revoked(smoke):
    _, records, _ = smoke
    for record in records:
        assert record.idle_s_to_zero is not None, record.idle_gauges
    layerkv = records[1]
    assert layerkv.balance_idle is not None and layerkv.balance_stopped is not None
    assert layerkv.balance_idle.started > 0 and layerkv.balance_idle.ended > 0
    assert layerkv.balance_idle.open == 0 and layerkv.balance_stopped.open == 0, layerkv.balance_stopped


def test_greedy_outputs_equal_the_no_connector_servers(smoke):
    plan, records, _ = smoke
    same, compared = same_outputs(records[1], records[0])
    assert compared == plan.workload.num_requests
    assert same == compared
