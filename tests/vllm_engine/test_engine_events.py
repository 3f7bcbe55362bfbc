"""KV cache events for routers from a real vLLM engine: subscribed to vLLM's own ZMQ event
stream (kv_events_config: publisher zmq, an ipc:// endpoint), the pool's blocks arrive as BlockStored events
(medium STORAGE, locality REMOTE) once committed, with the same block hashes, token ids and
parents as vLLM's own events for its local cache. On the "embedded" engine."""

from __future__ import annotations

import time

import pytest

from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("embedded")]


def _events_until(socket, decoder, done, timeout_s: float = 60.0) -> list:
    """Every event received until `done(events)` holds (bounded by `timeout_s`)."""
    import zmq

    events: list = []
    deadline = time.monotonic() + timeout_s
    while not done(events) and time.monotonic() < deadline:
        if socket.poll(timeout=200, flags=zmq.POLLIN):
            _topic, _seq, payload = socket.recv_multipart()
            events.extend(decoder.decode(payload).events)
    return events


def test_the_pool_s_blocks_reach_vllm_s_event_stream(fleet):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVEventBatch

    engine = fleet.get("embedded")
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        socket.connect(fleet.events_endpoint)  # the engine's publisher binds it (an ipc:// socket file)
        tokens = prompt(90, 3 * BLOCK_SIZE + 7)
        deadline = time.monotonic() + 120
        events: list = []

        def pool_blocks(events: list) -> list:
            """The pool's BlockStored events, the first of each block, in arrival order."""
            first: dict[int, object] = {}
            for e in events:
                if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE:
                    first.setdefault(e.block_hashes[0], e)
                    assert len(e.block_hashes) == 1, e
            return list(first.values())

        def complete(events: list) -> bool:
            """The pool's three blocks, and vLLM's own event for each of their hashes."""
            local = {
                h for e in events if isinstance(e, BlockStored) and e.medium != MEDIUM_STORAGE for h in e.block_hashes
            }
            pool = pool_blocks(events)
            return len(pool) >= 3 and all(e.block_hashes[0] in local for e in pool)

        # a SUB socket misses what is sent before it joined (on a loaded machine, vLLM's own events of
        # the first request may go by before it has), and a block committed after the engine's last step
        # is announced at its next step (the commits of the last steps may land after the request has
        # finished): generate again (each announces its blocks anew after the reset) until both have come,
        # never past the deadline
        while not complete(events) and time.monotonic() < deadline:
            engine.generate([tokens], reset_prefix_cache=True)  # computed (or loaded), saved, committed
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            events += _events_until(socket, decoder, lambda got: complete(events + got), timeout_s=10)
        by_block = {
            i: e
            for e in pool_blocks(events)
            for i in range(3)
            if e.token_ids == tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        }
        assert sorted(by_block) == [0, 1, 2] == list(range(len(pool_blocks(events)))), pool_diagnosis(engine)
        stored = [by_block[i] for i in range(3)]  # in prompt order (commits may be announced out of it)
        local = [e for e in events if isinstance(e, BlockStored) and e.medium != MEDIUM_STORAGE]
        by_hash = {h: e for e in local for h in e.block_hashes}
        for i, event in enumerate(stored):
            assert event.token_ids == tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            assert event.locality == "REMOTE" and event.block_size == BLOCK_SIZE
            (block_hash,) = event.block_hashes
            assert block_hash in by_hash, "vLLM's own event for the same block names it alike"
            assert event.parent_block_hash == (stored[i - 1].block_hashes[0] if i else None)
    finally:
        socket.close(linger=0)
        context.term()
