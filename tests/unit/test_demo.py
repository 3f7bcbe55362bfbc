from __future__ import annotations

import json

import pytest

from layerkv.cli import main
from layerkv.config import LayerKVConfig
from layerkv.demo import format_result, run_demo
from layerkv.engine import ModelConfig
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import FaultyStore

TINY = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)


def _run(store_factory, **kw):  # type: ignore[no-untyped-def]
    config = LayerKVConfig.from_dict({}, env={})
    return run_demo(config, store_factory=store_factory, num_docs=2, prefix_tokens=48, question_tokens=8,
                    max_tokens=3, model=TINY, progress=False, **kw)


def test_demo_loads_prefixes_and_matches_local_compute() -> None:
    root = EmbeddedStore(64 << 20)
    result = _run(lambda: CheckedStore(root.client(), max_batch_keys=64))
    assert result.identical, result.mismatch
    assert [r.loaded_tokens for r in result.rows] == [48, 48]  # 3 full blocks of 16 per prefix
    assert all(r.computed_tokens == r.prompt_tokens - 48 and r.range_calls == TINY.num_layers for r in result.rows)
    assert result.producer_saved_bytes > 0
    assert format_result(result).endswith("outputs identical to local compute: yes")


def test_demo_reports_a_mismatch_when_loaded_kv_is_wrong() -> None:
    """The oracle comparison can fail: a store that hands back other bytes (no error code) is caught."""
    root = EmbeddedStore(64 << 20)

    class CorruptingStore(FaultyStore):
        def batch_get_into_multi_buffer_ranges(self, keys, ptrs, sizes, offsets, layer_idx=None):  # type: ignore[no-untyped-def]
            got = super().batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets, layer_idx=layer_idx)
            if layer_idx == 1:  # overwrite the first byte-range of layer 1 with a copy of another block
                import ctypes

                ctypes.memset(ptrs[0][-1], 0x3F, 64)
            return got

    result = _run(lambda: CheckedStore(CorruptingStore(root.client()), max_batch_keys=64))
    assert not result.identical
    assert "differ" in result.mismatch or "tokens" in result.mismatch
    assert "outputs identical to local compute: NO" in format_result(result)


@pytest.mark.slow
def test_demo_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] is True and len(result["rows"]) == 4
    assert all(row["loaded_tokens"] == 384 for row in result["rows"])
