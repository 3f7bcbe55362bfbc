"""`layerkv bench load`'s parts that need no vLLM: the plan's sizes, the /metrics parsing, the
master's put balance (a real `layerkv master`), log phases, RSS of a process group and its
slope, the report's verdicts. The suite itself runs in the real-engine tier
(tests/vllm_engine/test_load_smoke.py)."""

from __future__ import annotations

import argparse
import os

import pytest

from layerkv.bench.load.plan import (
    BLOCK_SIZE,
    CAPACITY,
    DECODE,
    EVICTION,
    LAYERKV,
    NONE,
    SCENARIO_OF,
    TWO_SERVERS,
    LoadPlan,
)
from layerkv.bench.load.probe import (
    SHUTDOWN_NOISE,
    LogPhases,
    Series,
    gauges,
    hits_by_source,
    layerkv_counters,
    put_balance,
    rss_slope_pct_per_10min,
    total,
)
from layerkv.bench.load.report import LoadRecord, errors_by_phase, failed_requests, goals, row, same_outputs
from layerkv.bench.vllm.serve_proc import group_rss_bytes
from layerkv.commands.bench import duration_s


def test_plan_sizes_follow_the_working_set():
    plan = LoadPlan.build(tiny=False)
    w = plan.workload
    assert plan.scenarios == (CAPACITY, EVICTION, TWO_SERVERS) and plan.contenders == (NONE, LAYERKV, "mooncake")
    assert plan.local_blocks(SCENARIO_OF[CAPACITY]) * BLOCK_SIZE == w.working_set_tokens // 4
    assert plan.pool_bytes(SCENARIO_OF[EVICTION]) == w.working_set_tokens // 2 * plan.model.kv_bytes_per_token
    everything = (
        w.working_set_tokens + w.num_requests * (w.suffix_tokens + w.output_tokens)
    ) * plan.model.kv_bytes_per_token
    assert plan.pool_bytes(SCENARIO_OF[CAPACITY]) > everything
    soak = LoadPlan.build(tiny=False, soak_s=3600)  # thousands of requests: room for 256 requests' own blocks
    assert plan.pool_bytes(SCENARIO_OF[CAPACITY]) < soak.pool_bytes(SCENARIO_OF[CAPACITY]) < 2 * everything
    assert w.max_model_len % BLOCK_SIZE == 0 and w.max_model_len >= w.request_tokens
    # vLLM refuses a KV cache that cannot hold one max_model_len request
    tiny = LoadPlan.build(tiny=True)
    assert tiny.local_blocks(SCENARIO_OF[CAPACITY]) * BLOCK_SIZE >= tiny.workload.max_model_len


def test_a_soak_holds_the_capacity_scenario_for_its_duration():
    plan = LoadPlan.build(tiny=False, soak_s=1800, request_rate=0.5, contenders=(LAYERKV,))
    assert plan.scenarios == (CAPACITY,) and plan.contenders == (LAYERKV,)
    assert plan.workload.num_requests == 896  # 0.5 req/s x 1800 s, a multiple of the 16 prefixes
    assert plan.client_timeout_s() > 1800
    args = plan.client_args("http://127.0.0.1:1", "/m", "served")
    assert args[args.index("--num-prompts") + 1] == "896" and args[args.index("--request-rate") + 1] == "0.5"
    assert "--save-detailed" in args and args[args.index("--temperature") + 1] == "0"


def test_the_decode_scenario_runs_alone_with_distinct_prompts_and_a_bounded_number_in_flight():
    plan = LoadPlan.build(tiny=False, scenarios=(DECODE,))
    w = plan.workload
    assert plan.scenarios == (DECODE,) and w.num_prefixes == w.num_requests  # every prompt distinct: no hit
    args = plan.client_args("http://127.0.0.1:1", "/m", "served")
    assert args[args.index("--max-concurrency") + 1] == "16" and args[args.index("--request-rate") + 1] == "inf"
    assert "--max-concurrency" not in LoadPlan.build(tiny=False).client_args("http://127.0.0.1:1", "/m", "served")
    assert plan.local_blocks(SCENARIO_OF[DECODE]) * BLOCK_SIZE >= 16 * w.max_model_len  # all in flight fit locally
    assert 60 < plan.client_timeout_s() < 3600
    with pytest.raises(ValueError, match="decode runs alone"):
        LoadPlan.build(tiny=False, scenarios=(DECODE, CAPACITY))


def test_unknown_scenarios_and_contenders_are_refused():
    with pytest.raises(ValueError, match=r"unknown load scenario\(s\) \['bursty'\]; known: capacity, eviction"):
        LoadPlan.build(tiny=True, scenarios=("bursty",))
    with pytest.raises(ValueError, match=r"unknown load contender\(s\) \['sglang'\]"):
        LoadPlan.build(tiny=True, contenders=("sglang",))


def test_durations_parse_with_units():
    assert [duration_s(t) for t in ("30m", "2h", "900s", "45")] == [1800, 7200, 900, 45]
    for bad in ("soon", "-5m", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration_s(bad)


METRICS = """# HELP vllm:prompt_tokens_cached_by_source_total x
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 96.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="p2p"} 1856.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1856.0
vllm:layerkv_pending_puts{engine="0",tenant="bench"} 2.0
vllm:layerkv_staging_bytes_in_use{engine="0",tenant="bench"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:layerkv_total{counter="load_blocks",engine="0",rank="0"} 3.0
vllm:layerkv_total{counter="load_blocks",engine="0",rank="1"} 4.0
vllm:layerkv_total{counter="committed_keys",engine="0",rank="0"} 2.0
"""


def test_metrics_text_is_read_by_name_and_label():
    assert hits_by_source(METRICS) == {"device": 96.0, "p2p": 1856.0, "external_unspecified": 0.0}
    assert total(METRICS, "vllm:external_prefix_cache_hits_total") == 1856.0
    assert total(METRICS, "vllm:prompt_tokens_cached_by_source_total", 'source="p2p"') == 1856.0
    assert layerkv_counters(METRICS) == {"load_blocks": 7.0, "committed_keys": 2.0}
    assert gauges(METRICS) == {
        "layerkv_pending_puts": 2.0,
        "layerkv_staging_bytes_in_use": 0.0,
        "num_requests_running": 0.0,
        "num_requests_waiting": 1.0,
    }


@pytest.mark.mooncake
def test_put_balance_counts_started_ended_and_revoked_puts_on_a_real_master():
    from layerkv.store.local_master import LocalMaster
    from layerkv.store.mooncake import MooncakeStore
    from tests.mooncake_master import require_mooncake

    require_mooncake()
    master = LocalMaster(segment_size="64MB")
    store = MooncakeStore.from_mooncake_config(master.client_config)
    try:
        url = master.info["metrics_url"]
        keys = ["balance@a", "balance@b", "balance@c"]
        assert store.batch_put_session_start(keys, [4096] * 3) == [0, 0, 0]
        store.batch_put_session_end(keys[:1])
        store.batch_put_session_revoke(keys[1:2])
        open_one = put_balance(url)
        assert (open_one.started, open_one.ended, open_one.revoked, open_one.open) == (3, 1, 1, 1)
        store.batch_put_session_end(keys[2:])
        closed = put_balance(url)
        assert (closed.ended, closed.open, closed.key_count) == (2, 0, 2)
    finally:
        store.close()
        master.stop()


def test_log_phases_count_error_lines_per_phase_and_set_vllm_shutdown_noise_apart(tmp_path):
    path = tmp_path / "server.log"
    path.write_text("INFO starting\n")
    phases = LogPhases(path)
    phases.mark("start")
    with path.open("a") as log:
        log.write("(APIServer) ERROR 12-06 [serving.py:1] boom\n")
    phases.mark("load")
    with path.open("a") as log:
        log.write("Traceback (most recent call last):\n  File x\nValueError\n")
    phases.mark("stop")
    with path.open("a") as log:
        log.write(
            "(APIServer) ERROR [async_llm.py:906] AsyncLLM output_handler failed.\n"  # before the client stopped
            "INFO [core_client.py:777] [shutdown] MPClient: complete\n"
            "(APIServer) ERROR [async_llm.py:906] AsyncLLM output_handler failed.\n"
            "(APIServer) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x\n"
        )
    found = phases.errors()
    assert [len(found[p]) for p in ("start", "load", "stop", SHUTDOWN_NOISE)] == [1, 1, 1, 2]
    record = LoadRecord("capacity", LAYERKV, {}, log_errors={"layerkv-0": found})
    assert errors_by_phase(record) == {"start": 1, "load": 1, "idle": 0, "stop": 1}


def test_group_rss_sums_the_process_group_and_the_slope_sees_growth():
    assert group_rss_bytes(os.getpgid(0)) > 10 << 20  # this pytest process at least
    assert group_rss_bytes(2**22 + 12345) == 0  # no such group
    flat = Series([float(t) for t in range(0, 600, 10)], [1000 << 20] * 60)
    growing = Series(flat.t_s, [(1000 << 20) + int(t) * (1 << 20) // 60 for t in flat.t_s])  # +10 MiB per 10 min
    assert rss_slope_pct_per_10min(flat, 0, 600) == 0
    assert rss_slope_pct_per_10min(growing, 0, 600) == pytest.approx(1.0, rel=0.02)
    assert rss_slope_pct_per_10min(growing, 590, 600) is None  # fewer than 3 samples


def _record(contender: str, texts: list[str], errors: list[str], **client) -> LoadRecord:
    base = {
        "completed": len(texts),
        "failed": sum(bool(e) for e in errors),
        "generated_texts": texts,
        "errors": errors,
        "request_throughput": 1.0,
        "p99_ttft_ms": 100.0,
        "total_input_tokens": 1000,
    }
    return LoadRecord(
        CAPACITY, contender, {**base, **client}, external_hit_tokens=500.0, exit_codes={"x-0": 0}, idle_s_to_zero=0.5
    )


def test_outputs_are_compared_request_by_request_where_both_answered():
    reference = _record(NONE, ["a b", "c d", "e f", "g h"], ["", "", "", ""])
    ours = _record(LAYERKV, ["a b", "c X", "", "g h"], ["", "", "timeout", ""])
    assert same_outputs(ours, reference) == (2, 3)
    assert same_outputs(_record(LAYERKV, [], [], error="client died"), reference) == (0, 0)
    assert failed_requests(ours) == 1
    assert failed_requests(LoadRecord(CAPACITY, LAYERKV, {"error": "client died", "num_prompts": 24})) == 24


def test_goals_name_every_miss_and_compare_throughput_and_p99_ttft():
    none = _record(NONE, ["a"], [""], request_throughput=1.0, p99_ttft_ms=900.0)
    ours = _record(LAYERKV, ["a"], [""], request_throughput=1.5, p99_ttft_ms=200.0)
    peer = _record("mooncake", ["b"], ["boom"], request_throughput=1.2, p99_ttft_ms=150.0)
    peer.idle_s_to_zero, peer.exit_codes = None, {"x-0": 0, "x-1": None}
    records = [none, ours, peer]
    rows = [row(r, none) for r in records]
    assert (
        rows[1]["pool hit %"] == 50.0
        and rows[1]["same outputs as none"] == "1/1"
        and rows[0]["same outputs as none"] == "-"
    )
    lines = goals(records, rows)
    assert "capacity / layerkv: every health goal reached" in lines
    assert "capacity / mooncake: MISSED failed requests, gauges at 0 when idle, clean exit" in lines
    assert "capacity: layerkv 1.500 req/s ≥ none 1.000" in lines
    assert "capacity: layerkv TTFT p99 200 ms > best peer (mooncake) 150 ms" in lines


SHUTS_DOWN_ON_SIGTERM = """
import signal, sys, threading
done = threading.Event()
def first(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as uvicorn: a second SIGTERM kills
    print("stopping", flush=True)
    done.set()
signal.signal(signal.SIGTERM, first)
print("ready", flush=True)
done.wait(60)
done.clear()
done.wait(1.0)  # a graceful shutdown that takes a while
sys.exit(0)
"""


def test_a_server_is_sent_one_sigterm_and_exits_cleanly(tmp_path):
    import sys
    import time

    from layerkv.bench.vllm.serve_proc import ServeProcess

    server = ServeProcess("fake", [sys.executable, "-c", SHUTS_DOWN_ON_SIGTERM], 1, dict(os.environ), tmp_path)

    def wait_for(line: str) -> None:
        deadline = time.monotonic() + 30
        while line not in server.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the child's log for its next line, bounded

    wait_for("ready")
    server.request_stop()  # the fleets ask every server first, then wait for each in turn
    wait_for("stopping")  # this one is shutting down when its turn comes
    assert server.stop(timeout_s=30) == 0
    assert not server.alive()
