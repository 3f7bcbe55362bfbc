"""Request lifecycle and limits: a consumer-only worker advances its cursor, chunked prefill
saves each chunk and a resumed request re-reads the committed prefix, preemption and an
aborted step release everything, and transfer limits split calls by rows and bytes."""

from __future__ import annotations

from layerkv.messages import KVRole
from layerkv.store.faults import GET_END, GET_RANGES, GET_START, IS_EXIST, PUT_END, PUT_RANGES, PUT_START
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def test_consumer_only_worker_loads_and_advances_without_save_calls(make_rig) -> None:
    producer = make_rig(num_layers=5)
    tokens = block_tokens(6, BLOCK_SIZE)
    producer.run(Req("a", tokens))
    consumer = make_rig(num_layers=5, role=KVRole.CONSUMER, call_save=False, prefetch_layers=1, load_timeout_s=2.0)
    b = Req("b", tokens)
    ext, s = consumer.admit(b)
    assert ext == 6 * BLOCK_SIZE
    assert consumer.step([s]) == set()
    assert consumer.wrong_blocks(b, range(6)) == []
    assert [c.layer_idx for c in consumer.faults[0].calls(GET_RANGES)] == [0, 1, 2, 3, 4]
    assert consumer.faults[0].calls(PUT_START) == []  # a consumer never saves
    assert consumer.workers[0].stats().load_blocks == 6


def test_chunked_prefill_saves_each_chunk_and_resume_rereads_the_prefix(make_rig) -> None:
    rig = make_rig()
    a = Req("a", block_tokens(10, BLOCK_SIZE, extra=2))
    ext, s = rig.admit(a, budget=4 * BLOCK_SIZE)
    assert ext == 0
    per_step = []
    for _ in range(3):
        rig.faults[0].clear_calls()
        rig.step([s])
        per_step.append(len(rig.faults[0].keys_sent(PUT_START)))
        s = rig.chunk(a, 4 * BLOCK_SIZE)
    assert per_step == [4, 4, 2] and a.done
    assert rig.workers[0].stats().committed_keys == 8  # each step's saves commit with the next step
    rig.settle()
    assert rig.workers[0].stats().committed_keys == 10
    rig.step([], preempted=frozenset({"a"}))  # preempted: its blocks are freed
    old_blocks = list(a.block_ids)
    ext, s = rig.admit(a)  # resumed: new blocks, the pool has the whole prompt
    assert ext == 10 * BLOCK_SIZE and set(a.block_ids).isdisjoint(old_blocks)
    assert rig.step([s]) == set()
    assert rig.wrong_blocks(a, range(10)) == []


def test_preemption_and_an_aborted_step_release_everything(make_rig, backend) -> None:
    rig = make_rig()
    tokens = block_tokens(6, BLOCK_SIZE)
    p = Req("p", tokens[: 3 * BLOCK_SIZE] + [5])
    rig.run(p)
    rig.finish(p)
    a = Req("a", tokens)
    ext, s = rig.admit(a)
    assert ext == 3 * BLOCK_SIZE
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    worker.wait_for_layer_load(rig.layer_name(0))
    worker.save_kv_layer(rig.layer_name(0))
    worker.clear_connector_metadata()  # the step is abandoned after layer 0
    assert worker.is_idle(5.0)  # its jobs were cancelled: the save revoked, the load ended
    new_keys = rig.keys(a, blocks=[3, 4, 5])
    assert backend.processing_keys(new_keys) == []
    assert rig.pool_exists(new_keys) == [0, 0, 0]  # half-written: never committed
    rig.step([], preempted=frozenset({"a"}))
    assert worker.is_idle(5.0)
    assert len(rig.faults[0].calls(GET_END)) == len(rig.faults[0].calls(GET_START))


def test_transfer_limits_split_calls_by_rows_and_bytes(make_rig) -> None:
    # one block of one K or V entry: 4 tokens * 2 heads * 256 * 4 B = 8 KiB > 4 KiB limit
    rig = make_rig(head_dim=256, max_transfer_blocks=4, max_transfer_bytes=4096, exists_window_blocks=64)
    tokens = block_tokens(10, BLOCK_SIZE)
    a = Req("a", tokens)
    rig.run(a)
    f = rig.faults[0]
    for method, layer_idx in ((PUT_START, None), (PUT_RANGES, 0), (PUT_END, None)):
        rows = [len(c.keys) for c in f.calls(method) if c.layer_idx == layer_idx]
        assert rows == [4, 4, 2], (method, rows)
    puts = f.calls(PUT_RANGES)
    assert len(puts) == 3 * (rig.num_layers + 1)  # every layer, then the headers
    assert max(c.max_range_nbytes for c in puts) == 4096
    layer1 = [c for c in puts if c.layer_idx == 1]
    assert sum(c.num_ranges for c in layer1) == 10 * 4  # K and V, each in two 4 KiB pieces
    assert all(len(c.keys) <= 4 for c in rig.sched_faults.calls(IS_EXIST))
    b = Req("b", tokens)
    rig.admit(b)
    rig.step([rig.chunk(b)])
    gets = f.calls(GET_RANGES)
    assert [len(c.keys) for c in gets if c.layer_idx == 0] == [4, 4, 2]
    assert max(c.max_range_nbytes for c in gets) == 4096
    assert rig.wrong_blocks(b, range(10)) == []
    calls = rig.checked[0].stats()
    assert calls["batch_get_into_multi_buffer_ranges"].calls == 3 * rig.num_layers
    assert rig.workers[0].stats().load_range_calls == rig.num_layers  # one per layer, split by the store
