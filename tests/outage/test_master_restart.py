"""Master outage and restart with a real mooncake_master: the pool is a cache. While the master
is down the engine serves every request by recomputing (outputs equal local compute) without
paying Mooncake's ~4.4 s reconnect on every metadata call; after the restart (all objects gone)
the same store clients fill and use the pool again."""

from __future__ import annotations

import time

from layerkv.config import LayerKVConfig
from layerkv.engine import Engine, EngineConfig, ModelConfig
from layerkv.engine.pooled import pooled_engine
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import IS_EXIST, FaultyStore
from layerkv.store.mooncake_master import start_master
from tests.e2e.harness import assert_identical, serve
from tests.mooncake_master import connect_store, require_mooncake

MODEL = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
ENGINE = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=64, model_id="test/outage")
PREFIX = [(7 * i) % 128 for i in range(24)]
PROMPTS = [PREFIX + [1, 2, 3], PREFIX + [4, 5, 6, 7]]


def _serve(engine: Engine, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    """Serve `prompts` one at a time, then shut the engine down."""
    try:
        return serve(engine, prompts, 3)
    finally:
        engine.shutdown()


def test_engine_serves_through_a_master_outage_and_uses_the_pool_after_restart() -> None:
    require_mooncake()
    config = LayerKVConfig.from_dict({"store_retry_interval_s": 1.0}, env={})
    master = start_master()
    client = connect_store(master, 32 << 20)
    faulty = FaultyStore(client)  # records which calls reached the real client
    stores: list[CheckedStore] = []

    def store_factory() -> CheckedStore:
        stores.append(CheckedStore(faulty, max_batch_keys=64, retry_interval_s=config.store_retry_interval_s))
        return stores[-1]

    try:
        local = Engine(MODEL, ENGINE)  # same schedule as an engine that gets no pool hits
        cold = serve(local, PROMPTS, 3)
        _serve(pooled_engine(MODEL, ENGINE, config, store_factory=store_factory), PROMPTS[:1])  # fill the pool
        warm = _serve(pooled_engine(MODEL, ENGINE, config, store_factory=store_factory), PROMPTS[1:])
        assert warm[0].num_external_tokens == 24

        master.stop()
        faulty.clear_calls()
        down = _serve(pooled_engine(MODEL, ENGINE, config, store_factory=store_factory), PROMPTS)
        assert [o.num_external_tokens for o in down] == [0, 0]
        assert_identical(down, cold)  # served by recomputing, outputs exact
        # the scheduler's store asked the dead master once, then answered misses itself
        # (an outage was seen: the epoch moved; is_down() itself ends after the retry interval)
        assert stores[-2].outage_epoch > 0
        assert len(faulty.calls(IS_EXIST)) <= 2

        master.restart()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and client.batch_put_session_start(["probe"], [4096]) != [0]:
            time.sleep(0.2)  # the client re-mounts its segment on the restarted master
        client.batch_put_session_revoke(["probe"])
        time.sleep(config.store_retry_interval_s)  # let the connectors' retry interval pass
        _serve(pooled_engine(MODEL, ENGINE, config, store_factory=store_factory), PROMPTS[:1])
        again = _serve(pooled_engine(MODEL, ENGINE, config, store_factory=store_factory), PROMPTS[1:])
        assert again[0].num_external_tokens == 24  # the pool is used again (objects were refilled)
        assert_identical(again, warm)
    finally:
        client.close()
        master.stop()
