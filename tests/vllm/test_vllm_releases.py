"""Engines on different vLLM releases share one pool: a producer under the other release `make
test` installs (0.33.0 when this run imports 0.34.0, and the reverse) writes a prompt into a real
Mooncake pool, and a consumer under this run's release hits it, loads it and gets the stand-in
model's KV for those tokens: the same block hashes, the same namespace, the same object names.
(Mooncake only: the embedded store lives in one process, and two releases cannot.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.vllm_harness import require_vllm
from tests.vllm.worker_rig import clean_agent  # noqa: F401  (a fixture)

require_vllm()

from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import assert_blocks  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = ROOT / ".vllm-0.33"  # make test installs vLLM 0.33.0 here (Makefile VLLM_PREV)


def other_release_path() -> str:
    """The PYTHONPATH under which a child process imports the other release, and this checkout's
    layerkv (src/ first: an editable install may point at another checkout)."""
    this = importlib.metadata.version("vllm")
    if this.startswith("0.34."):
        if not (PREVIOUS / "vllm").is_dir():
            if os.environ.get("CI"):
                raise RuntimeError(f"{PREVIOUS} is missing: `make test` installs vLLM 0.33.0 there")
            pytest.skip(f"no vLLM 0.33.0 in {PREVIOUS} (make test installs it)")
        return os.pathsep.join((str(PREVIOUS), str(ROOT / "src"), str(ROOT)))
    if this.startswith("0.33."):  # this run put 0.33.0 first on PYTHONPATH: site-packages hold 0.34.0
        return os.pathsep.join((str(ROOT / "src"), str(ROOT)))
    pytest.skip(f"vLLM {this}: the release pair is 0.33 / 0.34")


@pytest.fixture
def pool(tmp_path, mooncake_master, clean_agent):  # noqa: F811 (the fixture imported above)
    """PoolNodes on the real Mooncake master only (the conftest's pool also runs embedded)."""
    from tests.vllm.pool_rig import PoolNodes

    nodes = PoolNodes("mooncake", tmp_path, mooncake_master)
    try:
        yield nodes
    finally:
        nodes.shutdown()


def test_a_pool_written_under_one_vllm_release_is_hit_under_the_other(pool):
    tokens = prompt(71, 56)  # 3 full blocks + 8 tokens
    env = {**os.environ, "PYTHONPATH": other_release_path()}
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.vllm.other_release_producer",
            pool.extra["mooncake_config_path"],
            pool.extra["tenant"],
            "71",
            str(len(tokens)),
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 180)
        line = child.stdout.readline() if ready else ""
        assert line, (
            f"the producer under the other release printed nothing: {child.poll()=} "
            f"{child.stderr.read() if child.poll() is not None else ''}"
        )
        produced = json.loads(line)
        this = importlib.metadata.version("vllm")
        assert produced["vllm"][:5] != this[:5] and {produced["vllm"][:5], this[:5]} == {"0.33.", "0.34."}
        assert produced["committed_keys"] == 3

        consumer = pool.node()
        request = consumer.add("c", tokens)
        assert [h.hex() for h in request.block_hashes] == produced["block_hashes"]
        assert consumer.core_worker.namespace.name == produced["namespace"]
        out, connector_output, _ = consumer.step()
        assert (
            out.num_scheduled_tokens == {"c": 8} and out.has_sync_kv_loads
        )  # 48 tokens from the other release's objects
        assert connector_output.invalid_block_ids == set()
        assert_blocks(consumer, "c", tokens, 3)
    finally:
        if child.poll() is None:
            child.stdin.write("done\n")
            child.stdin.flush()
        try:
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == 0, child.stderr.read()
