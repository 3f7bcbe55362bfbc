"""Tensor parallel 2 in a real vLLM engine (two worker processes, one core each) over a real
Mooncake master: each rank saves and loads its own storage rank's objects (two KV heads, one per
rank). Load faults are injected on the real store through FaultyLayerKVConnector.

Schedules line up by construction (both runs prefill in chunks of 64 tokens = 2 blocks from
token 0), so the KV bytes of a block are the same whether it was computed for the prefix alone
or for the whole request, and a pool-loaded request must equal the local-prefix-cache run bit
for bit.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm_engine.fault_control import arm, worker_state
from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("tp2")]


@pytest.fixture(scope="module")
def tp2(fleet):
    return fleet.get("tp2")


def test_tp2_ranks_save_and_load_bit_identical(tp2):
    prefix = prompt(40, 4 * BLOCK_SIZE)
    request = prefix + prompt(41, 20)
    (saved,) = tp2.generate([prefix], reset_prefix_cache=True)  # both ranks save their halves
    assert saved["num_cached_tokens"] == 0
    (local,) = tp2.generate([request], max_tokens=4)  # from vLLM's local prefix cache
    (pooled,) = tp2.generate([request], max_tokens=4, reset_prefix_cache=True)  # from the pool
    assert local["num_cached_tokens"] == pooled["num_cached_tokens"] == 4 * BLOCK_SIZE, pool_diagnosis(tp2)
    same_bits(pooled, local)


def test_request_aborted_while_it_loads_and_saves(tp2, fleet):
    faults = fleet.fault_dir("tp2")
    prefix = prompt(30, 4 * BLOCK_SIZE)
    request = prefix + prompt(31, 2 * BLOCK_SIZE + 10)  # its first step loads 4 blocks, computes and saves 2
    tp2.generate([prefix], reset_prefix_cache=True)

    # Both ranks' first range read stalls 3 s; the abort arrives while that step's loads are in
    # flight and its saves are open.
    arm(faults, 10, [{"kind": "delay", "delay_s": 3.0, "layer_idx": 0, "times": 1}], marker="loading-10")
    start = time.monotonic()
    result = tp2.call(
        "abort_while_loading", prompt=request, max_tokens=16, reset_prefix_cache=True, marker=str(faults / "loading-10")
    )
    assert (faults / "loading-10").exists()  # the abort was sent after the load had started
    assert not [o for o in result["outputs"] if o["finish_reason"] == "length"], "the request was not aborted"

    # The engine goes on, and whatever the aborted step left in the pool is right.
    (local,) = tp2.generate([request], max_tokens=3)  # local prefix cache: what the aborted step computed
    assert time.monotonic() - start >= 3.0  # the stalled step ran to its end first
    (pooled,) = tp2.generate([request], max_tokens=3, reset_prefix_cache=True)
    assert pooled["num_cached_tokens"] >= 4 * BLOCK_SIZE
    assert pooled["token_ids"] == local["token_ids"]
    if pooled["num_cached_tokens"] == local["num_cached_tokens"]:  # the aborted step committed its 2 blocks
        same_bits(pooled, local)
    tp2.generate([prompt(32, 3)])  # one more step carries the finished requests to the workers
    for rank in (0, 1):  # both workers applied the stall and hold nothing of any request
        state = worker_state(faults, rank)
        assert state["applied_seq"] == 10 and state["tracker_empty"], (rank, state)


def fault_run(tp2, fault_dir, seq: int, failing_ranks: list[int], seed: int) -> tuple[dict, dict, dict]:
    """The prefix (4 blocks) in the pool; then the request (prefix + 2 blocks + 10 tokens) loads
    it while `failing_ranks` fail layer 1 of every loaded block: vLLM recomputes from block 0.
    Returns (the faulted request, the same request from the local prefix cache, and from the pool)."""
    prefix = prompt(seed, 4 * BLOCK_SIZE)
    request = prefix + prompt(seed + 1, 2 * BLOCK_SIZE + 10)
    tp2.generate([prefix], reset_prefix_cache=True)
    arm(
        fault_dir,
        seq,
        [{"kind": "fail", "rank": r, "layer_idx": 1, "times": 1} for r in failing_ranks],
        marker=f"fault-{seq}",
    )
    (faulted,) = tp2.generate([request], max_tokens=4, reset_prefix_cache=True)
    assert (fault_dir / f"fault-{seq}").exists(), "the fault was not armed at a loading step"
    (local,) = tp2.generate([request], max_tokens=4)  # blocks 0-5 recomputed after the fault
    (pooled,) = tp2.generate([request], max_tokens=4, reset_prefix_cache=True)
    return faulted, local, pooled


def test_load_fault_on_every_rank_recomputes_and_poisons_nothing(tp2, fleet):
    faulted, local, pooled = fault_run(tp2, fleet.fault_dir("tp2"), 11, [0, 1], seed=50)
    assert faulted["token_ids"] == local["token_ids"]  # recomputed: correct output
    assert pooled["num_cached_tokens"] == 6 * BLOCK_SIZE  # blocks 4-5 were saved after the recompute
    same_bits(pooled, local)  # ... with the right bytes


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_load_fault_on_one_rank_recomputes_and_poisons_nothing(tp2, fleet, failing_rank):
    faulted, local, pooled = fault_run(
        tp2, fleet.fault_dir("tp2"), 12 + failing_rank, [failing_rank], seed=60 + 10 * failing_rank
    )
    assert faulted["token_ids"] == local["token_ids"]  # vLLM recomputed: passes today
    assert pooled["num_cached_tokens"] == 6 * BLOCK_SIZE
    same_bits(pooled, local)
