"""The commit protocol and the namespace through vLLM's real Scheduler and hook path: a step's
saves are committed only by a later step's verdict, never those of a request that shared a
block whose load failed (vLLM makes a block being loaded a prefix-cache hit for other requests
of the same step), and deployments whose weights or KV-shaping settings differ never share."""

from __future__ import annotations

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, require_vllm

require_vllm()

from layerkv.objects.keys import block_keys  # noqa: E402
from layerkv.store.base import Code  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import PoolNodes  # noqa: E402

pytestmark = pytest.mark.vllm


def _produce(pool: PoolNodes, tokens: list[int], **node_kwargs) -> None:
    producer = pool.node(**node_kwargs)
    producer.add("p", tokens)
    producer.run_to_completion()
    assert producer.core_worker.is_idle(5.0)


def _exists(node, hashes) -> list[int]:
    (side,) = node.scheduler.connector.scheduler_side.subs
    return side.store.batch_is_exist(block_keys(side.namespace, hashes, 0))


def _faulty_stores(monkeypatch) -> list:
    """Every store the vLLM facade opens from now on, wrapped in a FaultyStore (in opening order:
    the scheduler's, then the worker's)."""
    import layerkv.integrations.vllm.sides as sides
    from layerkv.store.checked import CheckedStore
    from layerkv.store.factory import open_store
    from layerkv.store.faults import FaultyStore

    faulty: list[FaultyStore] = []

    def open_faulty_store(config):
        faulty.append(FaultyStore(open_store(config)))
        return CheckedStore(faulty[-1], max_batch_keys=config.max_transfer_blocks)

    monkeypatch.setattr(sides, "OPEN_STORE", open_faulty_store)
    return faulty


def test_a_request_sharing_a_block_whose_load_failed_has_its_saves_revoked(pool, monkeypatch):
    from layerkv.store.faults import GET_RANGES

    prefix = prompt(8, 48)  # 3 full blocks
    _produce(pool, prefix + [3])
    faulty = _faulty_stores(monkeypatch)
    consumer = pool.node(
        max_num_batched_tokens=256, extra={"transfer_plan": "layers"}
    )  # the fault is on layer 1's read
    _, worker_faults = faulty  # scheduler, worker
    a = consumer.add("a", prefix + prompt(9, 40))  # loads blocks 0-2, computes 2 new full blocks
    b = consumer.add("b", prefix + prompt(10, 40))  # same step: blocks 0-2 are prefix-cache hits on a's
    block1 = a.block_hashes[1].hex()
    worker_faults.fail(GET_RANGES, lambda key: block1 in key, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1)

    out, connector_output, _ = consumer.step()

    assert out.num_scheduled_tokens == {"a": 40, "b": 40}  # b's 48 prefix tokens were a local hit
    ids_a, ids_b = consumer.block_ids("a"), consumer.block_ids("b")
    assert ids_a[:3] == ids_b[:3]  # b attends to the blocks a is loading
    assert connector_output.invalid_block_ids == {ids_a[1]}
    # vLLM rewound both: a to the invalid block (it recomputes it), b to before this step (its
    # output was computed over the bad block; it counts on a's recompute of the shared block)
    assert a.num_computed_tokens == BLOCK_SIZE and b.num_computed_tokens == 48
    new_b, new_a = b.block_hashes[3:5], a.block_hashes[3:5]

    consumer.step()  # carries the verdict on the failed step: both requests' saves revoked
    worker = consumer.core_worker
    assert worker.flush(10.0)  # staged saves write and settle on the write thread
    stats = worker.stats()
    assert stats.revoked_tainted == 4 and stats.committed_keys == 0, stats  # a's 2 and b's 2 new blocks
    assert consumer.scheduler.connector.scheduler_side.stats().tainted_requests == 2
    assert _exists(consumer, new_a) == [0, 0] and _exists(consumer, new_b) == [0, 0]
    consumer.run_to_completion()
    assert _exists(consumer, new_b) == [1, 1] and _exists(consumer, new_a) == [1, 1]  # recomputed, then committed
    assert worker.is_idle(5.0)


VARIANTS = {
    "revision": {"revision": "v2"},
    "layer count": {"hf_overrides": {"num_hidden_layers": 3}},
    "rope override": {"hf_overrides": {"rope_theta": 5000.0}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deployments_that_change_kv_bytes_never_share(pool, variant):
    tokens = prompt(11, 48)  # 2 full blocks can hit (one token is always computed)
    _produce(pool, tokens + [1] * 8)
    same = pool.node()
    other = pool.node(model_kwargs=VARIANTS[variant])
    assert (
        same.scheduler.connector.scheduler_side.subs[0].namespace
        == pool.nodes[0].scheduler.connector.scheduler_side.subs[0].namespace
    )
    assert (
        other.scheduler.connector.scheduler_side.subs[0].namespace
        != same.scheduler.connector.scheduler_side.subs[0].namespace
    )
    other.add("o", tokens)
    out, _, _ = other.step()
    assert out.num_scheduled_tokens == {"o": 48}  # nothing from the pool
    same.add("s", tokens)
    out, _, _ = same.step()
    assert out.num_scheduled_tokens == {"s": 48 - 2 * BLOCK_SIZE}  # 2 blocks from the pool
    other.run_to_completion()
    same.run_to_completion()


def test_quantization_changes_the_namespace():
    """A VllmConfig with fp8 weights cannot be built here (its validation imports
    compressed_tensors, not installed), so this swaps in an fp8 ModelConfig and compares what
    both roles put in the namespace."""
    from vllm.config import ModelConfig

    from layerkv.integrations.vllm.model_identity import model_fingerprint_of, model_settings_of
    from tests.vllm.vllm_harness import TINY_LLAMA, make_vllm_config

    plain, fp8 = make_vllm_config(), make_vllm_config()
    fp8.model_config = ModelConfig(
        model=str(TINY_LLAMA), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=1024, quantization="fp8"
    )
    assert model_fingerprint_of(plain) == model_fingerprint_of(fp8)
    assert model_settings_of(plain) != model_settings_of(fp8)
    assert model_settings_of(plain) == model_settings_of(make_vllm_config())


def test_a_failed_block_left_in_vllms_prefix_cache_is_recomputed_before_anyone_uses_it(pool, monkeypatch):
    """With kv_load_failure_policy="recompute" vLLM keeps a block whose load failed in its prefix
    cache, counting on the loading request to recompute it. If that request is aborted first, a
    later request hits the bad block locally: layerkv reports it invalid again in that step, so
    vLLM recomputes it, and the step's saves over it are revoked."""
    from vllm.v1.request import RequestStatus

    from layerkv.store.faults import GET_RANGES
    from tests.vllm.pool_rig import LAYERS, expected_block

    prefix = prompt(8, 48)  # 3 full blocks
    _produce(pool, prefix + [3])
    faulty = _faulty_stores(monkeypatch)
    consumer = pool.node(max_num_batched_tokens=256, extra={"transfer_plan": "layers"})
    _, worker_faults = faulty
    a = consumer.add("a", prefix + prompt(9, 40))
    worker_faults.fail(
        GET_RANGES, lambda key: a.block_hashes[1].hex() in key, code=int(Code.TRANSFER_FAIL), layer_idx=1, times=1
    )
    _, connector_output, _ = consumer.step()
    bad = consumer.block_ids("a")[1]
    assert connector_output.invalid_block_ids == {bad}
    consumer.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # before it recomputed the block

    c_tokens = prefix + prompt(11, 40)
    consumer.add("c", c_tokens)
    out, connector_output, _ = consumer.step()
    assert bad in consumer.block_ids("c")[:3]  # a local prefix-cache hit on the bad block
    assert connector_output.invalid_block_ids == {bad}  # reported again: vLLM rewinds c
    assert consumer.scheduler.connector.scheduler_side.stats().stale_blocks_reinvalidated == 1
    consumer.run_to_completion()
    assert consumer.core_worker.stats().revoked_tainted == 4  # a's 2 new blocks, then c's 2 computed over the bad block
    # c recomputed the block: every block of c holds what the model computes, in the pool
    verifier = pool.node()
    verifier.add("v", c_tokens)
    verifier.step()
    v_ids = verifier.block_ids("v")
    for name in LAYERS:
        for b in range(5):
            got = verifier.block(name, v_ids[b])
            assert (got == expected_block(LAYERS.index(name), c_tokens, b, got)).all(), f"{name} block {b} poisoned"
    verifier.run_to_completion()


def _step_with_report_held(node, held: list):
    """One engine step whose worker report (the step numbers it ran) is held back, as when a
    worker reports a step late; `held` gets the report, or gives the held one to this step."""
    from layerkv.bench.decode.engine import runner_output

    out = node.scheduler.schedule()
    node.model.begin_step(out)
    connector_output = node.worker.run_step(out, node.model.run_layer)
    late = held.pop() if held else None
    held.append(connector_output.kv_connector_worker_meta)
    connector_output.kv_connector_worker_meta = late
    node.scheduler.update_from_output(out, runner_output(node.scheduler, out, connector_output))


def test_vllm_keeps_stepping_until_the_last_steps_saves_are_committed(pool):
    tokens = prompt(31, 56)  # 3 full blocks + 8 tokens
    producer = pool.node()
    producer.add("p", tokens, max_tokens=1)
    held: list = []
    _step_with_report_held(producer, held)  # the prefill that saves; its report held back
    _step_with_report_held(producer, held)  # carries finished_req_ids; the report arrives now
    held.clear()
    assert not producer.scheduler.requests and not producer.scheduler.finished_req_ids
    # nothing left to run, but the verdict on the saves still has to reach the worker
    assert producer.scheduler.has_requests()
    while producer.scheduler.has_requests():
        producer.step()
    assert producer.core_worker.stats().committed_keys == 3
    assert _exists(producer, _hashes(producer, tokens)) == [1, 1, 1]


def test_a_step_never_reported_stops_holding_the_engine_after_commit_timeout(pool):
    import time

    tokens = prompt(32, 56)
    producer = pool.node(extra={"commit_timeout_s": 1.0})
    producer.add("p", tokens, max_tokens=1)
    held: list = []
    _step_with_report_held(producer, held)
    _step_with_report_held(producer, [None])  # the first report is lost for good
    assert producer.scheduler.has_requests()
    time.sleep(1.2)  # given up: one more step carries the revoke, then no endless stepping
    assert producer.scheduler.has_requests()
    producer.step()
    assert not producer.scheduler.has_requests()
    assert producer.core_worker.flush(5.0)
    assert producer.core_worker.stats().committed_keys == 0
    assert _exists(producer, _hashes(producer, tokens)) == [0, 0, 0]
    assert producer.core_worker.is_idle(5.0)


def _hashes(node, tokens: list[int]) -> list[bytes]:
    from tests.vllm.vllm_harness import make_request

    return list(make_request("h", tokens).block_hashes[:3])
