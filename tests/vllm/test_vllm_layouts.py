"""Every physical KV cache layout vLLM 0.33 and 0.34 allocate (`vllm/v1/kv_cache_layout.py`: logical
[L, B, H, N, C] permuted) through vLLM's own planning (`get_kv_cache_configs`) and allocation
(`allocate_kv_cache`): the block-compact ones register and move bytes through the real layerkv
core and a real store; the others are refused at startup with the fix; the connector asks vLLM
for LBHNC through vLLM's own layout resolution."""

from __future__ import annotations

import re

import pytest

from tests.vllm.vllm_harness import LAYERS, make_engine, make_vllm_config, require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from layerkv.errors import LayoutError, UnsupportedSetupError  # noqa: E402
from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402
from layerkv.integrations.vllm.setup import USABLE_LAYOUTS  # noqa: E402
from layerkv.objects.layout import CacheLayout  # noqa: E402
from tests.layouts import layers_adjacent  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import PoolNodes, assert_blocks, expected_block, produce  # noqa: E402

pytestmark = pytest.mark.vllm

SCATTERED = ("LHBNC", "BHLNC")  # each head of a block apart


@pytest.fixture
def pool(request, tmp_path, clean_agent):
    """Nodes on the store named by the test's `backend` parameter (embedded if it has none)."""
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else "embedded"
    master = request.getfixturevalue("mooncake_master") if backend == "mooncake" else None
    nodes = PoolNodes(backend, tmp_path, master)
    try:
        yield nodes
    finally:
        nodes.shutdown()


def test_the_six_layouts_split_into_usable_and_refused():
    assert {layout.name for layout in KVCacheLayout} == {*USABLE_LAYOUTS, *SCATTERED}  # vLLM added none
    assert set(USABLE_LAYOUTS) == {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_block_compact_layouts_register_vllm_allocation(pool, layout):
    node = pool.node(layout=layout)
    kv_caches = node.worker.kv_caches
    registered = node.core_worker.layout
    assert registered.num_layers == len(LAYERS) and all(registered.template(li).num_segments == 1 for li in range(2))
    cross_layer = layout.startswith("BL")
    assert layers_adjacent(registered, 0, 2) is cross_layer  # layers of a block side by side
    for layer_idx, name in enumerate(LAYERS):
        (entry,) = registered.layers[layer_idx]
        view = kv_caches[name]  # vLLM's logical [B, H, N, C] view
        assert entry.base_ptr == view.data_ptr() and entry.block_stride_nbytes == view.stride(0) * view.element_size()
        assert entry.block_nbytes == view[0].numel() * view.element_size()
    order = "@order=1,0,2" if "NHC" in layout else None
    assert (order in registered.signature) if order else ("@order" not in registered.signature)
    ns = node.scheduler.connector.scheduler_side.subs[0].namespace
    assert ns == node.core_worker.namespace  # the scheduler named the byte order without tensors
    assert node.core_worker.deployment.kv_signature.endswith(":order=NHC") is ("NHC" in layout)


@pytest.mark.parametrize("layout", SCATTERED)
def test_scattered_layouts_are_refused_at_startup_with_the_fix(layout):
    fix = (
        f"KV cache layout {layout}: each head of a block is stored apart, so one block of one layer is not one "
        f"byte run; layerkv needs one of LBHNC, LBNHC, BLHNC, BLNHC: set VLLM_KV_CACHE_LAYOUT=LBHNC"
    )
    with pytest.raises(UnsupportedSetupError, match=re.escape(fix)):
        make_engine(layout=layout)  # the scheduler-role connector is built with the Scheduler


@pytest.mark.parametrize("layout", SCATTERED)
def test_scattered_layouts_cannot_be_described_from_vllm_allocation(layout):
    # Below the facade: the layout of vLLM's real views is refused, never mis-described.
    from vllm.v1.worker.utils import allocate_kv_cache

    from tests.vllm.vllm_harness import make_kv_cache_config

    vllm_config = make_vllm_config(max_model_len=256)
    kv_cache_config = make_kv_cache_config(32, vllm_config=vllm_config, layout=layout)
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
    with pytest.raises(LayoutError, match="one block is not contiguous in memory"):
        CacheLayout.from_caches(kv_caches, 32, max_transfer_bytes=1 << 20)


@pytest.mark.parametrize(
    ("backend", "layout"), [("embedded", "LBNHC"), ("mooncake", "LBNHC"), ("embedded", "BLHNC"), ("mooncake", "BLNHC")]
)
def test_layout_round_trips_bytes_producer_to_consumer(pool, backend, layout):
    tokens = prompt(11, 56)  # 3 full blocks + 8 tokens
    producer, produced, saved = produce(pool, "p", tokens, layout=layout)
    assert (
        sum(o.kv_connector_stats.data.get("committed_keys", 0) for o in producer.outputs if o.kv_connector_stats) == 3
    )

    consumer = pool.node(layout=layout)
    request = consumer.add("c", tokens)
    loaded_at_layer: dict[str, bool] = {}

    def before_attention(name: str) -> None:  # after wait_for_layer_load(name): the layer is there
        ids, layer = consumer.block_ids("c"), LAYERS.index(name)
        loaded_at_layer[name] = all(
            torch.equal(consumer.block(name, ids[b]), expected_block(layer, tokens, b, consumer.block(name, ids[b])))
            for b in range(3)
        )

    out, connector_output, _ = consumer.step(before_attention)
    assert out.num_scheduled_tokens == {"c": 8} and out.has_sync_kv_loads  # 48 tokens from the pool
    assert loaded_at_layer == {name: True for name in LAYERS}
    assert connector_output.invalid_block_ids == set()
    assert_blocks(consumer, "c", tokens, 3, saved, request)  # == the producer's bytes and the formula
    consumer.run_to_completion()
    assert consumer.core_worker.is_idle(5.0)


@pytest.mark.parametrize("backend", ["mooncake"])
def test_byte_order_mismatch_is_a_miss_never_foreign_bytes(pool, backend):
    tokens = prompt(12, 56)
    produce(pool, "p", tokens, layout="LBHNC")  # [H, N, C] blocks in the pool

    same_bytes = pool.node(layout="BLHNC")  # cross-layer, same [H, N, C] bytes per block: shares objects
    same_bytes.add("s", tokens)
    out, _, _ = same_bytes.step()
    assert out.num_scheduled_tokens == {"s": 8}

    other_order = pool.node(layout="LBNHC")  # [N, H, C] blocks: another namespace, no hit
    other_order.add("o", tokens)
    out, connector_output, _ = other_order.step()
    assert out.num_scheduled_tokens == {"o": 56} and not out.has_sync_kv_loads
    assert connector_output.invalid_block_ids == set()
    assert_blocks(other_order, "o", tokens, 3)  # computed here, correct in its own layout


def test_connector_asks_vllm_for_lbhnc_through_vllm_layout_resolution(monkeypatch):
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)

    def resolve(supported: list[str]) -> str:
        vllm_config = make_vllm_config()
        assert vllm_config.cache_config.kv_cache_layout is None
        return resolve_kv_cache_layout(vllm_config, [supported]).name

    assert LayerKVConnector.get_required_kvcache_layout(make_vllm_config()) == "LBHNC"
    assert resolve(["LHBNC", "LBHNC"]) == "LBHNC"  # ROCm attention's list: its first choice is refused
    assert resolve(["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]) == "LBHNC"  # no declaration
    assert resolve(["LBNHC"]) == "LBNHC"  # the backend cannot: vLLM keeps LBNHC, which layerkv accepts
    assert resolve(["BLHNC"]) == "BLHNC"

    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")  # a pinned layout wins; layerkv asks nothing
    assert LayerKVConnector.get_required_kvcache_layout(make_vllm_config()) is None
    assert resolve(["LBHNC", "LBNHC"]) == "LBNHC"
