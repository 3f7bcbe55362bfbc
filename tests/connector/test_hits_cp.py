"""The scheduler side under decode context parallelism (connector/scheduler.py, connector/lookup.py):
a block of the engine (block_size x dcp tokens, one hash) is a hit only when every CP rank's share is
COMPLETE under that rank's namespace; a share missing on one CP rank ends the hit at that block.
On the embedded store and the real Mooncake master."""

from __future__ import annotations

import dataclasses

from layerkv.config import LayerKVConfig
from layerkv.connector.scheduler import SchedulerConnector
from layerkv.messages import Deployment, RequestView
from layerkv.objects.keys import block_keys, namespace_for, share_deployment
from layerkv.store.checked import CheckedStore
from tests.backends import Backend

BLOCK = 4  # tokens per rank's cache block
DCP = 2


def deployment(backend: Backend, pp_size: int = 1) -> Deployment:
    return Deployment(
        model_id=f"test/cp-{backend.tag}",
        kv_dtype="float16",
        block_size=BLOCK,
        num_kv_heads=1,
        is_mla=True,
        tp_size=2,
        dcp_size=DCP,
        cp_interleave=2,
        pp_size=pp_size,
        kv_signature="mla",
    )


def test_a_hit_needs_every_cp_rank_and_stage_share(backend: Backend) -> None:
    base = deployment(backend, pp_size=2)
    store = CheckedStore(backend.client(), max_batch_keys=64)
    scheduler = SchedulerConnector(LayerKVConfig.from_dict({}, env={}), base, store)
    hashes = tuple(bytes([i + 1]) * 8 for i in range(4))
    view = RequestView("r", 4 * BLOCK * DCP + 1, 4 * BLOCK * DCP + 1, hashes)
    written: list[str] = []

    def commit(stage: int, cp_rank: int, blocks: range) -> None:
        ns = namespace_for(share_deployment(base, stage, cp_rank), "default")
        keys = block_keys(ns, [hashes[b] for b in blocks], 0)
        assert store.batch_put_session_start(keys, [64] * len(keys)) == [0] * len(keys)
        assert store.batch_put_session_end(keys) == [0] * len(keys)
        written.extend(keys)

    try:
        for stage in (0, 1):
            commit(stage, 0, range(4))
        assert scheduler.get_num_new_matched_tokens(view, 0) == (0, False)  # CP rank 1 holds nothing
        commit(0, 1, range(4))
        commit(1, 1, range(0, 1))
        commit(1, 1, range(2, 4))  # stage 1's CP rank 1 misses block 1
        # a hit in engine blocks of BLOCK x DCP tokens, ending where one share is missing
        assert scheduler.get_num_new_matched_tokens(view, 0) == (BLOCK * DCP, False)
        commit(1, 1, range(1, 2))
        assert scheduler.get_num_new_matched_tokens(view, 0) == (4 * BLOCK * DCP, False)
        share = namespace_for(share_deployment(base, 1, 1), "default")
        assert store.batch_remove(block_keys(share, [hashes[2]], 0)) == [0]  # stage 1, CP rank 1, block 2
        assert scheduler.get_num_new_matched_tokens(view, 0) == (2 * BLOCK * DCP, False)
    finally:
        scheduler.shutdown()
        backend.close(written)


def test_computed_tokens_count_in_engine_blocks(backend: Backend) -> None:
    """A lookup starts only on an engine block's boundary (BLOCK x DCP tokens), never a rank block's."""
    base = deployment(backend)
    store = CheckedStore(backend.client(), max_batch_keys=64)
    scheduler = SchedulerConnector(LayerKVConfig.from_dict({}, env={}), base, store)
    hashes = tuple(bytes([i + 9]) * 8 for i in range(3))
    view = RequestView("r", 3 * BLOCK * DCP + 1, 3 * BLOCK * DCP + 1, hashes)
    keys = [
        key for c in range(DCP) for key in block_keys(namespace_for(share_deployment(base, 0, c), "default"), hashes, 0)
    ]
    try:
        assert store.batch_put_session_start(keys, [64] * len(keys)) == [0] * len(keys)
        assert store.batch_put_session_end(keys) == [0] * len(keys)
        assert scheduler.get_num_new_matched_tokens(view, 0) == (3 * BLOCK * DCP, False)
        assert scheduler.get_num_new_matched_tokens(view, BLOCK * DCP) == (2 * BLOCK * DCP, False)
        assert scheduler.get_num_new_matched_tokens(view, BLOCK) == (0, False)  # inside an engine block
        assert dataclasses.replace(base, dcp_size=1, cp_interleave=1).scheduler_block_size == BLOCK
    finally:
        scheduler.shutdown()
        backend.close(keys)
