"""The embedded store in a real vLLM engine: one process (engine core and the "uni" executor in
the host process: VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni"; on CPU
vLLM turns "uni" into its multiprocess executor unless engine-core multiprocessing is off), so
the scheduler and the worker share the process-wide pool. Where they cannot (the multiprocess
executor), the connector refuses to start and says what to do instead."""

from __future__ import annotations

import pytest

from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("embedded", "embedded-mp")]


def test_embedded_pool_in_one_process_is_bit_identical(fleet):
    engine = fleet.get("embedded")
    prefix = prompt(70, 4 * BLOCK_SIZE)
    request = prefix + prompt(71, 20)
    engine.generate([prefix], reset_prefix_cache=True)
    (local,) = engine.generate([request], max_tokens=4)
    (pooled,) = engine.generate([request], max_tokens=4, reset_prefix_cache=True)
    assert local["num_cached_tokens"] == pooled["num_cached_tokens"] == 4 * BLOCK_SIZE, pool_diagnosis(engine)
    same_bits(pooled, local)
    counters = engine.call("metrics")["layerkv"]
    assert counters.get("load_blocks", 0) >= 4 and counters.get("committed_keys", 0) >= 4


def test_embedded_pool_across_processes_refuses_to_start(fleet):
    reply = fleet.engines["embedded-mp"].startup()
    assert not reply["ready"], "an engine whose embedded pool can never hit must not serve"
    assert "layerkv backend='embedded' keeps the pool inside one process" in reply["error"] + reply[
        "traceback"
    ] + fleet.engines["embedded-mp"].log_path.read_text(errors="replace")
