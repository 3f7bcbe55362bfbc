from __future__ import annotations

import json

import pytest

from layerkv.cli import main
from layerkv.config import LayerKVConfig
from layerkv.demos.demo import format_result, run_demo
from layerkv.engine import ModelConfig
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import GET_RANGES, FaultyStore

TINY = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)


def _run(store_factory, plan: str = "layers", config_extra=None, **kw):  # type: ignore[no-untyped-def]
    config = LayerKVConfig.from_dict({"transfer_plan": plan, **(config_extra or {})}, env={})
    return run_demo(
        config,
        store_factory=store_factory,
        num_docs=2,
        prefix_tokens=48,
        question_tokens=8,
        max_tokens=3,
        model=TINY,
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("plan", ["auto", "layers"])
def test_demo_loads_prefixes_and_matches_local_compute(plan: str) -> None:
    root = EmbeddedStore(64 << 20)
    result = _run(lambda: CheckedStore(root.client(), max_batch_keys=64), plan)
    assert result.identical, result.mismatch
    assert [r.loaded_tokens for r in result.rows] == [48, 48]  # 3 full blocks of 16 per prefix
    assert all(r.computed_tokens == r.prompt_tokens - 48 for r in result.rows)
    if plan == "layers":  # one range call per layer; auto may read groups or whole objects
        assert all(r.range_calls == TINY.num_layers for r in result.rows)
    assert result.producer_saved_bytes > 0
    assert format_result(result).endswith("outputs identical to local compute: yes")


def test_demo_reports_the_time_the_compute_waited_for_layers_and_the_local_ceiling() -> None:
    """Every layer read is held 20 ms (FaultyStore.delay), so the compute thread waits at least
    for layer 0 of each request; `waited ms` must show it, within the request's TTFT."""
    root = EmbeddedStore(64 << 20)

    def store() -> CheckedStore:
        faulty = FaultyStore(root.client())
        faulty.delay(GET_RANGES, 0.02)
        return CheckedStore(faulty, max_batch_keys=64)

    result = _run(store)
    assert result.identical, result.mismatch
    for row in result.rows:
        assert 15.0 <= row.load_wait_ms <= row.ttft_pool_ms
        assert row.ttft_local_ms > 0.0  # measured (never compared with the pool's: both are clocks)
    table = format_result(result)
    assert "TTFT local ms" in table and "waited ms" in table
    assert f"{result.rows[0].load_wait_ms:.1f}" in table.splitlines()[2]


def _corrupting(root: EmbeddedStore, *, on_layer: int, target_layer: int):  # type: ignore[no-untyped-def]
    """A store whose range read of `on_layer` also overwrites 64 bytes of the last range of
    the same call's first key at `target_layer` (the target layer's ranges are one call earlier
    when target_layer < on_layer, i.e. after that layer was verified)."""

    class CorruptingStore(FaultyStore):
        last_ptrs: dict[int, int] = {}

        def batch_get_into_multi_buffer_ranges(self, keys, ptrs, sizes, offsets, layer_idx=None):
            got = super().batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets, layer_idx=layer_idx)
            self.last_ptrs[layer_idx] = ptrs[0][-1]
            if layer_idx == on_layer:
                import ctypes

                ctypes.memset(self.last_ptrs[target_layer], 0x3F, 64)
            return got

    return lambda: CheckedStore(CorruptingStore(root.client()), max_batch_keys=64)


def test_checksums_catch_bytes_a_store_hands_back_wrong() -> None:
    """A store that hands back other bytes (no error code) for layer 1: the layer checksum fails,
    the block is recomputed and removed from the pool, the outputs stay identical."""
    result = _run(_corrupting(EmbeddedStore(64 << 20), on_layer=1, target_layer=1))
    assert result.identical, result.mismatch
    assert result.checksum_failures > 0


def test_demo_reports_a_mismatch_when_loaded_kv_is_wrong() -> None:
    """The oracle comparison can fail: bytes overwritten in the cache after their layer was
    verified (a corruption no checksum can see; reads straight into a registered cache make it
    possible) are caught as different outputs."""
    result = _run(
        _corrupting(EmbeddedStore(64 << 20), on_layer=2, target_layer=1), config_extra={"register_kv_cache": True}
    )
    assert not result.identical
    assert "differ" in result.mismatch or "tokens" in result.mismatch
    assert "outputs identical to local compute: NO" in format_result(result)


@pytest.mark.slow
def test_demo_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] is True and len(result["rows"]) == 4
    assert all(row["loaded_tokens"] == 384 for row in result["rows"])
