"""The oracle on a GPU: the reference engine in bf16 with its KV caches on the device; a producer
saves through pinned host staging (side-stream copies after each layer's compute event), a
fresh consumer loads (copies into the cache on the side stream, the compute stream waiting on
their events), and its logits are torch.equal to computing locally on the same device. Faults
on top of the embedded store: read delays, a failed read, bytes corrupted in staging (each
recomputed, outputs identical). TTFT of recompute, the local prefix cache and the pool is
written to $LAYERKV_GPU_REPORT (JSON lines) when set: figures, never asserted."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from layerkv.engine import EngineConfig, ModelConfig
from layerkv.store.faults import GET_RANGES
from tests.e2e.harness import (
    assert_identical,
    assert_loaded,
    computed_chunks,
    local_oracle,
    prompts_with_prefix,
    random_tokens,
    serve,
)
from tests.gpu.conftest import DEVICE

BLOCK = 16
MODEL = ModelConfig(
    num_layers=8,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=2048,
    seed=11,
    dtype="bfloat16",
)
PREFIX = random_tokens(6 * BLOCK + 5, seed=3, vocab=MODEL.vocab_size)  # 6 full blocks + 5 tokens
HIT = 6 * BLOCK
MAX_TOKENS = 3
POOL = {"transfer_plan": "groups", "read_layers_per_range": 1, "load_timeout_s": 20.0, "save_timeout_s": 20.0}


def engine(**changes: Any) -> EngineConfig:
    return EngineConfig(
        **{
            "block_size": BLOCK,
            "num_blocks": 128,
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "device": DEVICE,
            **changes,
        }
    )


def docs(seed: int, n: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Producer prompts, and consumer prompts sharing their 6 full blocks (other tails)."""
    producer = prompts_with_prefix(PREFIX, 1, 3, seed, MODEL.vocab_size)
    return producer, prompts_with_prefix(PREFIX, n, 7, seed + 1, MODEL.vocab_size)


def run_oracle(make_oracle: Any, engine_config: EngineConfig, *, consumer_batched: bool = False, **layerkv: Any) -> Any:
    oracle = make_oracle(model=MODEL, engine_config=engine_config, **{**POOL, **layerkv})
    producer_prompts, consumer_prompts = docs(seed=21)
    producer = oracle.pooled()
    serve(producer.engine, producer_prompts, MAX_TOKENS)
    consumer = oracle.pooled()
    return oracle, consumer, producer_prompts, consumer_prompts, consumer_batched


def check(
    oracle: Any, consumer: Any, producer_prompts: Any, consumer_prompts: Any, batched: bool, *, loaded: bool = True
) -> Any:
    got = serve(consumer.engine, consumer_prompts, MAX_TOKENS, batched=batched)
    want = local_oracle(oracle.local(), producer_prompts, consumer_prompts, MAX_TOKENS, consumer_batched=batched)
    assert_identical(got, want)
    if loaded:
        assert_loaded(consumer, got, HIT)
    return got


def test_kv_caches_are_on_the_device(make_oracle) -> None:
    oracle = make_oracle(model=MODEL, engine_config=engine(), **POOL)
    run = oracle.pooled()
    caches = run.engine.caches_for_rank(0)
    assert {t.device.type for t in caches.values()} == {torch.device(DEVICE).type}
    assert {t.dtype for t in caches.values()} == {torch.bfloat16}
    views = run.workers[0]._jobs.caches.views
    assert not views.on_host  # the device path: staging only
    assert type(views.copies).__name__ == ("StreamCopies" if DEVICE != "cpu" else "HostCopies")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_pool_equals_local_compute(make_oracle, tp) -> None:
    check(*run_oracle(make_oracle, engine(tp_size=tp)))


def test_a_shared_prefix_fans_out_to_every_request_of_a_batch(make_oracle) -> None:
    oracle, consumer, producer_prompts, _, _ = run_oracle(make_oracle, engine())
    consumer_prompts = prompts_with_prefix(PREFIX, 4, 7, 99, MODEL.vocab_size)
    got = check(oracle, consumer, producer_prompts, consumer_prompts, True, loaded=False)
    assert [o.num_external_tokens + o.num_local_cached_tokens for o in got] == [HIT] * 4


@pytest.mark.parametrize("prefetch", [1, 4])
def test_slow_reads_are_waited_for_and_outputs_unchanged(make_oracle, prefetch) -> None:
    oracle, consumer, p, c, b = run_oracle(make_oracle, engine(), prefetch_layers=prefetch)
    consumer.rank_faults(0).delay(GET_RANGES, 0.005)  # every read 5 ms late
    check(oracle, consumer, p, c, b)
    assert consumer.workers[0].stats().load_failed_blocks == 0


def test_a_failed_read_and_corrupted_staging_are_recomputed(make_oracle) -> None:
    """One consumer's layer-3 read fails; a peer scribbles over another consumer's staging as
    its layer 5 lands: each prompt is recomputed whole, in the chunks a fresh local engine uses,
    with bit-identical outputs."""
    oracle, first, _, c, _ = run_oracle(make_oracle, engine())
    second = oracle.pooled()
    failed = first.rank_faults(0).fail(GET_RANGES, layer_idx=3, times=1)
    area = second.workers[0]._areas.loads.array

    def corrupt(keys: Any, args: Any) -> None:
        np.bitwise_xor(area, 0x5A, out=area)

    scribbled = second.rank_faults(0).then(GET_RANGES, corrupt, layer_idx=5, times=1)
    for consumer, rule in ((first, failed), (second, scribbled)):
        out = serve(consumer.engine, c, MAX_TOKENS)[0]
        assert consumer.rank_faults(0).fired(rule) == 1
        assert consumer.workers[0].stats().load_failed_blocks == HIT // BLOCK
        local = oracle.local()
        want = serve(local, c, MAX_TOKENS)[0]
        assert computed_chunks(consumer.engine, out.req_id) == computed_chunks(local, want.req_id)  # all recomputed
        assert_identical([out], [want])
    assert second.workers[0].stats().checksum_failures > 0


def test_a_step_that_loads_and_saves_at_once(make_oracle) -> None:
    """A consumer loads the 6-block prefix and, in the same step, computes and saves two new
    full blocks (load copies on one stream, save copies on the other, both against the same
    compute stream); a fresh engine then loads all 8 blocks, and both equal local compute."""
    oracle, consumer, producer_prompts, _, _ = run_oracle(make_oracle, engine())
    longer = prompts_with_prefix(PREFIX, 1, 2 * BLOCK + 3, 31, MODEL.vocab_size)  # 8 full blocks + 8 tokens
    got = check(oracle, consumer, producer_prompts, longer, False)
    # the load and the computation of blocks 6 and 7 were one step, and both blocks were put
    assert computed_chunks(consumer.engine, got[0].req_id)[0] == (HIT, len(longer[0]) - HIT)
    assert consumer.workers[0].is_idle(10.0) and consumer.workers[0].stats().save_keys >= 2
    fresh = oracle.pooled()
    again = serve(fresh.engine, longer, MAX_TOKENS)
    local = oracle.local()
    want = local_oracle(local, producer_prompts, longer, MAX_TOKENS)  # computed as the consumer did
    assert_identical(got, want)
    assert_identical(again, serve(local, longer, MAX_TOKENS))  # the 8 blocks from its own prefix cache
    assert_loaded(fresh, again, 8 * BLOCK)


# MLA under decode context parallelism: per-rank blocks of 16 tokens, engine blocks of 32 (HIT: 3 of them)
DCP_MODEL = dataclasses.replace(MODEL, mla_latent_dim=128, seed=12)


@pytest.mark.parametrize("interleave", [1, BLOCK])
def test_dcp_mla_pool_equals_local_compute_and_one_cp_ranks_fault_recomputes(make_oracle, interleave) -> None:
    """MLA tp2/dcp2: the consumer's logits equal a local DCP engine's; then a layer-3 read fails
    on CP rank 1 only and the prompt is recomputed whole, identical to a fresh local engine."""
    config = engine(tp_size=2, dcp_size=2, cp_interleave=interleave)
    oracle = make_oracle(model=DCP_MODEL, engine_config=config, **POOL)
    producer_prompts, consumer_prompts = docs(seed=41)
    serve(oracle.pooled().engine, producer_prompts, MAX_TOKENS)
    consumer = oracle.pooled()
    got = serve(consumer.engine, consumer_prompts, MAX_TOKENS)
    assert_identical(got, local_oracle(oracle.local(), producer_prompts, consumer_prompts, MAX_TOKENS))
    assert_loaded(consumer, got, HIT)
    faulty = oracle.pooled()
    failed = faulty.rank_faults(1).fail(GET_RANGES, layer_idx=3, times=1)
    out = serve(faulty.engine, consumer_prompts, MAX_TOKENS)[0]
    assert faulty.rank_faults(1).fired(failed) == 1 and faulty.workers[0].stats().load_failed_blocks == 0
    assert faulty.workers[1].stats().load_failed_blocks == HIT // config.scheduler_block_size
    local = oracle.local()
    want = serve(local, consumer_prompts, MAX_TOKENS)[0]
    assert computed_chunks(faulty.engine, out.req_id) == computed_chunks(local, want.req_id)  # all recomputed
    assert_identical([out], [want])


def test_the_demo_on_the_device_serves_identical_outputs(device_path) -> None:
    """`layerkv demo --device cuda` in small: producer, consumer from the pool, local oracle."""
    from layerkv.config import LayerKVConfig
    from layerkv.demos.demo import run_demo

    model = ModelConfig(
        num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, dtype="bfloat16"
    )
    result = run_demo(
        LayerKVConfig.from_dict({}, env={}),
        progress=False,
        model=model,
        num_docs=2,
        prefix_tokens=48,
        question_tokens=8,
        max_tokens=3,
        device=DEVICE,
    )
    assert result.identical, result.mismatch
    assert all(row.loaded_tokens > 0 for row in result.rows)


def _ttft_ms(calls: list[Any]) -> float:
    """Median wall time of each call (one first token each), the device drained after it."""
    times = []
    for call in calls:
        start = time.perf_counter()
        call()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def test_ttft_of_recompute_local_cache_and_pool(make_oracle) -> None:
    """Figures for the report: first-token time of a long prompt computed from scratch, served
    from the engine's own prefix cache (the ceiling) and loaded from the pool by a fresh engine."""
    repeats = 3
    # the dry run on the CPU (tests/integration/test_gpu_check.py) checks the flow, not the figures: a shorter prompt
    prefix = random_tokens((64 if DEVICE != "cpu" else 16) * BLOCK, seed=5, vocab=MODEL.vocab_size)
    config = engine(num_blocks=512, max_num_batched_tokens=2048)
    oracle = make_oracle(model=MODEL, engine_config=config, **POOL)
    serve(oracle.pooled().engine, [prefix + [1]], 1)
    recompute, ceiling = oracle.local(), oracle.local()
    serve(recompute, [random_tokens(8, seed=1, vocab=MODEL.vocab_size)], 1)  # warm-up
    serve(ceiling, [prefix + [1]], 1)
    consumers = [oracle.pooled() for _ in range(repeats)]  # a fresh one per repeat: every hit from the pool
    figures: dict[str, Any] = {
        "recompute_ms": _ttft_ms(
            [
                lambda i=i: recompute.generate(
                    [random_tokens(len(prefix) + 1, seed=100 + i, vocab=MODEL.vocab_size)], 1
                )
                for i in range(repeats)
            ]
        ),
        "local_cache_ms": _ttft_ms([lambda i=i: ceiling.generate([prefix + [2 + i]], 1) for i in range(repeats)]),
        "pool_ms": _ttft_ms(
            [lambda run=run, i=i: run.engine.generate([prefix + [20 + i]], 1) for i, run in enumerate(consumers)]
        ),
    }
    assert all(
        run.workers[0].stats().load_failed_blocks == 0 and run.workers[0].stats().loaded_bytes > 0 for run in consumers
    )
    figures.update(device=DEVICE, tokens=len(prefix) + 1, layers=MODEL.num_layers, dtype=MODEL.dtype)
    print("ttft", json.dumps(figures))
    if os.environ.get("LAYERKV_GPU_REPORT"):
        with open(os.environ["LAYERKV_GPU_REPORT"], "a") as report:
            report.write(json.dumps(figures) + "\n")


def test_decode_step_time_with_and_without_the_connector(make_oracle) -> None:
    """Figures for the report: the time per decode token (ITL) of a batch decoding together, on an
    engine without a connector and on one with layerkv's (nothing in the pool to load; the blocks
    decode completes are saved). ITL = (time of N + 1 tokens - time of 1 token) / N, each the
    median of 3 batches, the device drained after each."""
    batch, new_tokens = (8, 64) if DEVICE != "cpu" else (2, 8)
    config = engine(num_blocks=512, max_num_batched_tokens=2048)
    oracle = make_oracle(model=MODEL, engine_config=config, **POOL)
    engines = {"none": oracle.local(), "layerkv": oracle.pooled().engine}

    def itl_ms(run: Any, seed: int) -> float:
        prompts = [random_tokens(2 * BLOCK + 3, seed=seed + i, vocab=MODEL.vocab_size) for i in range(batch)]
        one = _ttft_ms([lambda k=k: run.generate([p + [k] for p in prompts], 1) for k in range(3)])
        more = _ttft_ms([lambda k=k: run.generate([p + [10 + k] for p in prompts], new_tokens + 1) for k in range(3)])
        return (more - one) / new_tokens

    for run in engines.values():
        serve(run, [random_tokens(8, seed=2, vocab=MODEL.vocab_size)], 2)  # warm-up
    figures: dict[str, Any] = {
        f"itl_{name}_ms": itl_ms(run, 500 + 100 * i) for i, (name, run) in enumerate(engines.items())
    }
    figures.update(device=DEVICE, batch=batch, new_tokens=new_tokens, layers=MODEL.num_layers, dtype=MODEL.dtype)
    assert all(value > 0 for key, value in figures.items() if key.startswith("itl_"))
    print("itl", json.dumps(figures))
    if os.environ.get("LAYERKV_GPU_REPORT"):
        with open(os.environ["LAYERKV_GPU_REPORT"], "a") as report:
            report.write(json.dumps(figures) + "\n")
