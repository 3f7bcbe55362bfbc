"""Suite `decode`: the meters on their own, then one tiny run of the suite (vLLM's real scheduler
and worker hook path, layerkv on the embedded store and no connector) checked for what it must
have counted. The numbers themselves are not checked: benchmarks report, tests check behaviour."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from layerkv.bench import OPT_IN_SUITES, SUITES
from layerkv.bench.common import BenchOptions
from layerkv.bench.decode.meters import MethodTimer, StoreCallCounter


class _Hooks:
    def outer(self) -> int:
        return self.inner() + 1

    def inner(self) -> int:
        return 1

    def untimed(self) -> int:
        return 0


def test_method_timer_counts_calls_once_per_outer_call_and_uninstalls() -> None:
    hooks = _Hooks()
    timer = MethodTimer(hooks, ["outer", "inner", "missing"])
    assert timer.names == ["outer", "inner"]
    assert hooks.outer() == 2 and hooks.untimed() == 0
    totals = timer.take()
    assert dict(totals.calls) == {"outer": 1, "inner": 1}
    assert (
        0 < totals.method_ns["inner"] <= totals.method_ns["outer"] == totals.ns
    )  # inner is inside outer: not added twice
    assert timer.take().ns == 0  # take() resets
    worker = threading.Thread(target=hooks.inner)
    worker.start()
    worker.join(5)
    assert timer.take().other_thread_calls == 1
    timer.remove()
    hooks.inner()
    assert timer.take().calls == {}
    assert "inner" not in vars(hooks)


class _Store:
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)

    def batch_put_from(self, keys: list[str]) -> list[int]:
        return self.batch_is_exist(keys)  # nested: counted once


def test_store_call_counter_splits_driver_and_other_threads() -> None:
    store = _Store()
    counter = StoreCallCounter(store, ["batch_is_exist", "batch_put_from"])
    store.batch_is_exist(["a"])
    store.batch_put_from(["a", "b"])
    worker = threading.Thread(target=store.batch_is_exist, args=(["c"],), name="layerkv-send-0")
    worker.start()
    worker.join(5)
    calls = counter.take()
    assert dict(calls.driver) == {"batch_is_exist": 1, "batch_put_from": 1}
    assert dict(calls.other) == {"batch_is_exist": 1}
    assert calls.total() == 3
    assert counter.take().total() == 0
    counter.remove()
    store.batch_is_exist(["d"])
    assert counter.take().total() == 0


def test_decode_is_an_opt_in_suite() -> None:
    assert "decode" in OPT_IN_SUITES and "decode" not in SUITES


# ------------------------------------------------------------------ one tiny run of the suite


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """The suite through the bench runner (as `layerkv bench decode` runs it): (options, result)."""
    from tests.vllm.vllm_harness import require_vllm

    require_vllm()
    from layerkv.bench.runner import run_bench

    options = BenchOptions(quick=True, tiny=True, mooncake=False, out_dir=tmp_path_factory.mktemp("decode"))
    doc = run_bench(["decode"], options, progress=False)
    assert "## decode" in (options.out_dir / "results.md").read_text()
    return options, SimpleNamespace(**doc["suites"]["decode"])


def _rows(result, contender: str, num_requests: int) -> dict[str, dict]:
    return {r["steps"]: r for r in result.rows if r["contender"] == contender and r["requests"] == num_requests}


def test_every_contender_ran_every_batch_size_for_the_configured_steps(tiny_run) -> None:
    from layerkv.bench.decode import suite as decode

    options, result = tiny_run
    size = decode.sizes(options)
    assert not [n for n in result.notes if "did not run" in n], result.notes
    assert any("skipped: --no-mooncake" in n for n in result.notes)
    # the first timed step computes token PROMPT + warm-up decode steps + 1 (the prefill is one step)
    first = decode.PROMPT_TOKENS + size.warm_decode_steps + 1
    expected_block_steps = sum(1 for c in range(first, first + size.timed_steps) if (c + 1) % 16 == 0)
    assert expected_block_steps >= 1  # the tiny sizes must exercise both kinds of step
    for contender in (decode.LAYERKV_EMBEDDED, decode.NONE):
        for n in size.batch_sizes:
            rows = _rows(result, contender, n)
            assert set(rows) == {decode.IDLE, decode.BLOCK}, (contender, n, rows)
            assert rows[decode.BLOCK]["num_steps"] == expected_block_steps
            assert rows[decode.IDLE]["num_steps"] + rows[decode.BLOCK]["num_steps"] == size.timed_steps
            assert all(r["schedule_us_p50"] > 0 for r in rows.values())


def test_layerkv_per_layer_hooks_and_store_calls_are_counted(tiny_run) -> None:
    from layerkv.bench.decode import suite as decode

    options, result = tiny_run
    size = decode.sizes(options)
    for n in size.batch_sizes:
        for row in _rows(result, decode.LAYERKV_EMBEDDED, n).values():
            assert row["wait_load_calls"] == row["save_layer_calls"] == size.num_layers * row["num_steps"]
            assert row["sched_us_p50"] > 0 and row["worker_us_p50"] > 0
            assert row["host_us_p50"] >= row["worker_us_p50"]
            assert row["store_calls_driver"] is not None and row["store_calls_total"] >= row["store_calls_driver"]
            assert row["pct_of_schedule"] is not None
        for row in _rows(result, decode.NONE, n).values():
            assert row["host_us_p50"] is None and row["wait_load_calls"] is None and row["store_calls_total"] is None
    # every arriving request is looked up in the pool on the scheduling thread: one exists query at least
    warmups = result.tables["warm-up (arrival, prefill, first decode steps; untimed in the rows above)"]
    for row in warmups:
        if row["contender"] == decode.LAYERKV_EMBEDDED:
            assert row["exists_calls_driver"] >= row["requests"], row
            assert row["store_calls_total"] >= row["store_calls_driver"]
    hooks = result.tables[f"per hook at N={max(size.batch_sizes)}"]
    idle_layer_hooks = {
        r["method"]: r["calls_per_step"]
        for r in hooks
        if r["contender"] == decode.LAYERKV_EMBEDDED and r["steps"] == decode.IDLE and r["where"] == "worker connector"
    }
    assert idle_layer_hooks["wait_for_layer_load"] == idle_layer_hooks["save_kv_layer"] == size.num_layers
    assert idle_layer_hooks["bind_connector_metadata"] == 1


def test_the_report_has_headlines_and_a_plot(tiny_run) -> None:
    options, result = tiny_run
    assert "layerkv-embedded.N4.idle.host_us_p50" in result.summary
    assert "none.N4.idle.schedule_us_p50" in result.summary
    assert result.plots and (Path(options.out_dir) / result.plots[0]).is_file()
