"""Oracle scenario over the real Mooncake master: the producer engine runs in another process
with its own Mooncake client; the consumer engine runs here and must equal the local run."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import layerkv
from tests.e2e.harness import (
    MODEL,
    assert_identical,
    local_oracle,
    prompts_with_prefix,
    random_tokens,
    serve,
    small_engine,
)

pytestmark = pytest.mark.mooncake
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 3


@pytest.mark.parametrize("backend", ["mooncake"], indirect=True)
def test_producer_and_consumer_in_two_processes(make_oracle, backend, mooncake_master, tmp_path: Path) -> None:
    oracle = make_oracle(engine_config=small_engine(tp_size=2))
    prefixes = [random_tokens(22, seed=51), random_tokens(22, seed=52)]
    producer_prompts = [prompts_with_prefix(p, 1, 6, seed=53 + i)[0] for i, p in enumerate(prefixes)]
    consumer_prompts = [prompts_with_prefix(p, 1, 9, seed=55 + i)[0] for i, p in enumerate(prefixes)]
    job = {
        "mooncake": mooncake_master.config(global_segment_size=16 << 20),
        "model": dataclasses.asdict(MODEL),
        "engine": dataclasses.asdict(oracle.engine_config),
        "prompts": producer_prompts,
        "max_tokens": MAX_TOKENS,
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(
        os.environ,
        MC_TCP_BIND_ADDRESS="127.0.0.1",
        PYTHONPATH=os.pathsep.join([str(Path(layerkv.__file__).parents[1]), str(REPO_ROOT)]),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.producer_process", str(tmp_path / "job.json")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc, lines), name="layerkv-test-producer-out", daemon=True)
    reader.start()
    put_keys: list[str] = []
    try:
        report = _wait_report(proc, lines, timeout_s=90.0)
        put_keys = report["put_keys"]
        assert report["trackers_empty"]
        assert all(s["committed_keys"] > 0 and s["save_failed_keys"] == 0 for s in report["stats"]), report["stats"]
        assert not backend.processing_keys(put_keys)

        consumer = oracle.pooled()
        got = serve(consumer.engine, consumer_prompts, MAX_TOKENS)
        want = local_oracle(oracle.local(), producer_prompts, consumer_prompts, MAX_TOKENS)
        assert_identical(got, want)
        assert [o.num_external_tokens for o in got] == [20, 20]
        assert set(consumer.rank_faults(0).keys_sent("batch_get_session_start")) <= set(put_keys)
        assert all(w.stats().load_range_calls > 0 and w.stats().load_failed_blocks == 0 for w in consumer.workers)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the producer closes its client and exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        reader.join(timeout=5)
        backend.remove(put_keys)
    assert proc.returncode == 0


def _read_lines(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def _wait_report(proc: subprocess.Popen[str], lines: queue.Queue[str | None], timeout_s: float) -> dict:
    while True:
        line = lines.get(timeout=timeout_s)
        assert line is not None, f"producer exited with {proc.poll()} before reporting"
        if line.startswith("@@"):
            return json.loads(line[2:])
