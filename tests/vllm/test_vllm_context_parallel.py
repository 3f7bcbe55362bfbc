"""Decode context parallelism (vLLM's decode_context_parallel_size) through vLLM's REAL Scheduler
and worker hooks on CPU: one scheduler and TP=4 worker rigs (DCP=2, each told its ranks through
parallel.WORKER_RANKS), each rank's stand-in model writing only its interleaved share of every
engine block (BLOCK_SIZE x DCP tokens, what vLLM hashes) into its own per-rank cache blocks.
Both backends. Also: the facade's DCP setup (accepted, refused) and its block sizes against
vLLM's own resolvers."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from tests.vllm.vllm_harness import (
    BLOCK_SIZE,
    LAYERS,
    make_engine,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    require_vllm,
)

require_vllm()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from layerkv.bench.decode.engine import runner_output  # noqa: E402
from layerkv.errors import UnsupportedSetupError  # noqa: E402
from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402
from layerkv.integrations.vllm.parallel import ParallelRanks  # noqa: E402
from layerkv.objects.keys import block_keys  # noqa: E402
from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import SAMPLED_TOKEN, StandInModel, kv_rows  # noqa: E402
from tests.vllm.test_vllm_events import Recorder  # noqa: E402
from tests.vllm.worker_rig import WorkerRig, make_worker  # noqa: E402

pytestmark = pytest.mark.vllm

TP, DCP, INTERLEAVE = 4, 2, 4
ENGINE_BLOCK = BLOCK_SIZE * DCP  # tokens per block hash
# (KV heads, ranks that write): 2 heads over 4 ranks = 2 head groups x 2 CP shares, every rank
# writes its own; 1 head (MQA) = 4 replicas of one head, ranks 2 and 3 repeat the shares of 0 and 1
SHAPES = {"gqa": (2, (0, 1, 2, 3)), "mqa": (1, (0, 1))}


def parallel_kwargs(tp: int = TP, dcp: int = DCP, interleave: int = INTERLEAVE) -> dict:
    return dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave)


def heads_override(num_kv_heads: int) -> dict:
    return {"model_kwargs": {"hf_overrides": {"num_key_value_heads": num_kv_heads}}} if num_kv_heads != 2 else {}


def share_slots(positions: torch.Tensor, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which of `positions` CP rank `cp_rank` holds and where (vLLM's DCP slot mapping, design
    §1.4): (local mask, engine block index, offset in the rank's cache block) of each position."""
    engine_block, offset = positions // ENGINE_BLOCK, positions % ENGINE_BLOCK
    local = (offset // INTERLEAVE) % DCP == cp_rank
    local_offset = (offset // (INTERLEAVE * DCP)) * INTERLEAVE + offset % INTERLEAVE
    return local, engine_block, local_offset


class ShareModel(StandInModel):
    """One rank's stand-in model: the KV of its head group (a function of it) for the positions
    of its CP share only; the other positions' slots are never written, as in vLLM."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], cp_rank: int, head_group: int) -> None:
        super().__init__(kv_caches)
        self.cp_rank, self.head_group = cp_rank, head_group

    def rows(self, layer_name: str, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        cache = self.kv_caches[layer_name]
        return kv_rows(
            LAYERS.index(layer_name), positions, tokens + 97 * self.head_group, cache.shape[1], cache.shape[3]
        )

    def run_layer(self, layer_name: str) -> None:
        cache = self.kv_caches[layer_name]  # [num_blocks, H, BLOCK_SIZE, C]
        for req_id, first, count in self._writes:
            tracked = self._requests[req_id]
            positions = torch.arange(first, first + count)
            tokens = torch.tensor([tracked.tokens[p] if p < len(tracked.tokens) else SAMPLED_TOKEN for p in positions])
            local, engine_block, offset = share_slots(positions, self.cp_rank)
            blocks = torch.tensor(tracked.block_ids)[engine_block[local]]
            cache[blocks, :, offset[local], :] = self.rows(layer_name, positions[local], tokens[local])

    def expected_block(self, layer_name: str, tokens: list[int], block_idx: int) -> torch.Tensor:
        """What this rank's cache block of engine block `block_idx` holds when full: [H, BLOCK_SIZE, C]."""
        positions = torch.arange(block_idx * ENGINE_BLOCK, (block_idx + 1) * ENGINE_BLOCK)
        local, _, offset = share_slots(positions, self.cp_rank)
        want = torch.zeros_like(self.kv_caches[layer_name][0])
        rows = self.rows(layer_name, positions[local], torch.tensor(tokens)[positions[local]])  # [T, H, C]
        want[:, offset[local], :] = rows.permute(1, 0, 2)
        return want


@dataclass
class CpNode:
    """One vLLM instance under TP x DCP: vLLM's real Scheduler, one worker rig per TP rank (its
    ranks through the seam) and vLLM's own KVOutputAggregator over their outputs, as its
    executor combines them. `stores[0]` is the scheduler's store, `stores[1 + r]` rank r's
    (FaultyStore without rules: they record the keys each one sent)."""

    engine: Any
    ranks: list[WorkerRig]
    models: list[ShareModel]
    stores: list[Any]
    aggregator: Any
    closed: bool = field(default=False)

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    def core(self, rank: int) -> Any:
        (worker,) = self.ranks[rank].connector.worker_side.subs
        return worker

    def add(self, req_id: str, tokens: list[int]) -> Any:
        request = make_request(req_id, tokens, hash_block_size=ENGINE_BLOCK)
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[Any, Any]:
        out = self.scheduler.schedule()
        outputs = []
        for rig, model in zip(self.ranks, self.models):
            model.begin_step(out)
            outputs.append(runner_output(self.scheduler, out, rig.run_step(out, model.run_layer)))
        merged = self.aggregator.aggregate(outputs)
        self.scheduler.update_from_output(out, merged)
        return out, merged.kv_connector_output

    def run_to_completion(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            self.step()
            if not self.scheduler.has_requests():
                assert all(self.core(r).flush(5.0) for r in range(TP)), "writes / commits did not finish"
                return
        raise AssertionError(f"requests still running after {max_steps} steps")

    def shutdown(self) -> None:
        """Every rank's connector and the scheduler, in parallel (closing a Mooncake client takes 1-2 s)."""
        if not self.closed:
            self.closed = True
            closers = [rig.connector.shutdown for rig in self.ranks] + [self.scheduler.shutdown]
            with ThreadPoolExecutor(max_workers=len(closers)) as pool:
                list(pool.map(lambda close: close(), closers))
            alive = [name for r in range(TP) for name in self.core(r).threads_alive()]
            assert not alive, f"transfer threads still alive after shutdown: {alive}"


@pytest.fixture
def cp_nodes(pool, monkeypatch):
    """Builds CpNodes on `pool`'s backend and tenant (kv_heads: the model's KV heads); every
    store they open is recorded (FaultyStore without rules); all are shut down after the test."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    import layerkv.integrations.vllm.sides as sides
    from layerkv.store.checked import CheckedStore
    from layerkv.store.factory import open_store
    from layerkv.store.faults import FaultyStore

    opened: list[FaultyStore] = []

    def open_recorded_store(config):
        opened.append(FaultyStore(open_store(config)))
        return CheckedStore(opened[-1], max_batch_keys=config.max_transfer_blocks)

    monkeypatch.setattr(sides, "OPEN_STORE", open_recorded_store)
    nodes: list[CpNode] = []

    def build(kv_heads: int = 2, **config_kwargs) -> CpNode:
        first = len(opened)
        engine = make_engine(
            extra=pool.extra, parallel_kwargs=parallel_kwargs(), **heads_override(kv_heads), **config_kwargs
        )
        put_step = TP // kv_heads
        ranks = [make_worker(engine, ParallelRanks(r, 0, r % DCP)) for r in range(TP)]
        models = [ShareModel(rig.kv_caches, r % DCP, r // put_step) for r, rig in enumerate(ranks)]
        aggregator = KVOutputAggregator.from_connector(engine.scheduler.connector, TP)
        nodes.append(CpNode(engine, ranks, models, opened[first:], aggregator))
        return nodes[-1]

    try:
        yield build
    finally:
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as closing:
            list(closing.map(CpNode.shutdown, nodes))


def keys_of(node: CpNode, rank: int, hashes: list[bytes]) -> set[str]:
    """Rank `rank`'s object keys of `hashes`: its own CP namespace and storage rank."""
    core = node.core(rank)
    return set(block_keys(core.namespace, hashes, core.storage_rank))


def produce(cp_nodes, shape: str, tokens: list[int]) -> tuple[CpNode, Any]:
    producer = cp_nodes(SHAPES[shape][0])
    request = producer.add("p", tokens)
    producer.run_to_completion()
    return producer, request


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_rank_saves_and_loads_its_own_share_of_whole_engine_blocks(cp_nodes, shape):
    from layerkv.store.faults import GET_START, PUT_START

    tokens = prompt(48, 3 * ENGINE_BLOCK + 8)  # 3 engine blocks (6 per-rank blocks of 16) + 8 tokens
    producer, request = produce(cp_nodes, shape, tokens)
    hashes = list(request.block_hashes[:3])
    assert len(request.block_hashes) == 3  # vLLM hashes engine blocks: 104 tokens are 3 of them
    (side,) = producer.scheduler.connector.scheduler_side.subs
    namespaces = [producer.core(r).namespace for r in range(TP)]
    # one namespace per CP share: rank r's is the scheduler's share r % DCP, and the two differ
    assert [ns.name for ns in namespaces] == [side._writing[r % DCP].name for r in range(TP)]
    assert namespaces[0].name != namespaces[1].name
    writers = SHAPES[shape][1]
    for r in range(TP):
        put = set(producer.stores[1 + r].keys_sent(PUT_START))
        assert put == (keys_of(producer, r, hashes) if r in writers else set()), f"rank {r}"

    consumer = cp_nodes(SHAPES[shape][0], max_num_batched_tokens=256)
    consumer.add("c", tokens)
    out, connector_output = consumer.step()
    # the hit is whole engine blocks: 3 x 32 tokens, the 8 left computed
    assert out.num_scheduled_tokens == {"c": 8} and out.has_sync_kv_loads
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * ENGINE_BLOCK
    assert connector_output.invalid_block_ids == set()
    (ids,) = consumer.scheduler.kv_cache_manager.get_block_ids("c")
    for r in range(TP):  # every rank (writer or not) read its own share's objects, and got its share's bytes
        assert set(consumer.stores[1 + r].keys_sent(GET_START)) == keys_of(consumer, r, hashes), f"rank {r}"
        model = consumer.models[r]
        for name in LAYERS:
            for b in range(3):
                got = consumer.ranks[r].kv_caches[name][ids[b]]
                assert torch.equal(got, model.expected_block(name, tokens, b)), f"rank {r} {name} block {b}"


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_block_missing_one_cp_share_ends_the_hit(cp_nodes, cp_rank):
    tokens = prompt(49, 3 * ENGINE_BLOCK + 8)
    producer, request = produce(cp_nodes, "gqa", tokens)
    # rank cp_rank holds share cp_rank of head group 0: delete that one object of block 1
    (gone,) = keys_of(producer, cp_rank, [request.block_hashes[1]])
    assert producer.stores[0].batch_remove([gone]) == [0]

    consumer = cp_nodes(max_num_batched_tokens=256)
    consumer.add("c", tokens)
    out, connector_output = consumer.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == ENGINE_BLOCK  # block 0 only: block 1 lacks a share
    assert out.num_scheduled_tokens == {"c": 2 * ENGINE_BLOCK + 8}
    assert connector_output.invalid_block_ids == set()


def test_pool_events_count_engine_blocks(cp_nodes):
    """The pool's BlockStored events carry engine blocks (BLOCK_SIZE x DCP tokens), as vLLM's own."""
    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored

    producer = cp_nodes(kv_events=True)
    recorder = Recorder()
    producer.scheduler.kv_event_publisher = recorder
    tokens = prompt(50, 2 * ENGINE_BLOCK + 8)
    producer.add("p", tokens)
    producer.run_to_completion()
    stored = [e for e in recorder.events if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE]
    assert [e.token_ids for e in stored] == [tokens[:ENGINE_BLOCK], tokens[ENGINE_BLOCK : 2 * ENGINE_BLOCK]]
    assert {e.block_size for e in stored} == {ENGINE_BLOCK}
    assert producer.scheduler.connector._steps.block_size == ENGINE_BLOCK  # a decode step's "completes a block"


# ---------------------------------------------------------------- setup: accepted and refused


def dcp_connector(role, ranks: ParallelRanks | None = None, kv_cache_config=None, **config_kwargs):
    """A facade of `role` on vLLM's config with DCP (parallel_kwargs() unless given); a worker's
    ranks through the seam, as the rigs above."""
    import layerkv.integrations.vllm.parallel as parallel

    config_kwargs.setdefault("parallel_kwargs", parallel_kwargs())
    config_kwargs.setdefault("max_model_len", 128)  # fits the 16 blocks of make_kv_cache_config(16)
    vllm_config = make_vllm_config(**config_kwargs)
    kv_cache_config = kv_cache_config or make_kv_cache_config(16, vllm_config=vllm_config)
    seam = parallel.WORKER_RANKS
    if ranks is not None:
        parallel.WORKER_RANKS = lambda _config: ranks
    try:
        return LayerKVConnector(vllm_config, role, kv_cache_config), vllm_config, kv_cache_config
    finally:
        parallel.WORKER_RANKS = seam


def test_a_dcp_deployment_names_each_rank_its_share(doubles):
    scheduler, _, _ = dcp_connector(KVConnectorRole.SCHEDULER)
    worker, _, _ = dcp_connector(KVConnectorRole.WORKER, ParallelRanks(3, 0, 1))
    d = worker.deployment
    assert (d.tp_size, d.tp_rank, d.dcp_size, d.dcp_rank, d.cp_interleave) == (TP, 3, DCP, 1, INTERLEAVE)
    assert (d.block_size, d.scheduler_block_size, d.num_kv_heads) == (BLOCK_SIZE, ENGINE_BLOCK, 2)
    assert scheduler.deployment == replace(d, tp_rank=0, dcp_rank=0)
    # the deprecated dcp_kv_cache_interleave_size overrides the new field when set, as vLLM does
    old = parallel_kwargs(interleave=2) | {"dcp_kv_cache_interleave_size": 8}
    assert dcp_connector(KVConnectorRole.SCHEDULER, parallel_kwargs=old)[0].deployment.cp_interleave == 8
    no_dcp, _, _ = dcp_connector(KVConnectorRole.SCHEDULER, parallel_kwargs={})
    assert (no_dcp.deployment.dcp_size, no_dcp.deployment.cp_interleave) == (1, 1)


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (2, 4), (2, 16)])
def test_the_engine_block_is_vllms_own(doubles, dcp, interleave):
    """layerkv's scheduler block size equals what vLLM's resolvers give its Scheduler and hasher."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes

    connector, vllm_config, kv_cache_config = dcp_connector(
        KVConnectorRole.SCHEDULER, parallel_kwargs=parallel_kwargs(dcp=dcp, interleave=interleave)
    )
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    expected = connector.deployment.scheduler_block_size
    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (expected, expected)
    assert resolve_dcp_kv_block_size(spec, dcp) == expected == BLOCK_SIZE * dcp
    assert (connector.deployment.block_size, kv_cache_config.hash_block_size) == (spec.block_size, expected)


def test_a_hash_block_size_other_than_the_engine_block_is_refused(doubles):
    vllm_config = make_vllm_config(parallel_kwargs=parallel_kwargs(), max_model_len=128)
    kv_cache_config = make_kv_cache_config(16, vllm_config=vllm_config)
    kv_cache_config.hash_block_size = BLOCK_SIZE  # the per-rank block: not what vLLM hashes under DCP
    message = "hash_block_size=16 differs from the KV block size 16 x decode_context_parallel_size 2"
    with pytest.raises(UnsupportedSetupError, match=re.escape(message)):
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def _refused(vllm_config, kv_cache_config=None) -> str:
    kv_cache_config = kv_cache_config or make_kv_cache_config(16, vllm_config=vllm_config)
    with pytest.raises(UnsupportedSetupError) as info:
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    return str(info.value)


def test_prefill_context_parallelism_is_refused_with_its_reason(doubles):
    # set after construction: vLLM 0.33 refuses PCP in its config already under model runner V1 (its default)
    vllm_config = make_vllm_config(parallel_kwargs=dict(tensor_parallel_size=2), max_model_len=128)
    object.__setattr__(vllm_config.parallel_config, "prefill_context_parallel_size", 2)
    assert "prefill_context_parallel_size=2; layerkv supports only 1 (PCP needs vLLM's V2 GPU model runner and " in (
        _refused(vllm_config)
    )
    assert not doubles.schedulers


def test_dcp_setups_layerkv_cannot_name_are_refused(doubles):
    vllm_config = make_vllm_config(parallel_kwargs=parallel_kwargs(), max_model_len=128)
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float16)
    sliding = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float16, sliding_window=64
    )
    hybrid = _refused(vllm_config, make_kv_cache_config(16, [full, sliding]))
    assert "decode_context_parallel_size=2 with 2 KV cache groups (a hybrid model)" in hybrid
    unsharded = replace(full, dcp_sharded=False)
    assert "a KV cache spec that is not DCP-sharded" in _refused(vllm_config, make_kv_cache_config(16, [unsharded]))
    object.__setattr__(vllm_config.parallel_config, "cp_kv_cache_interleave_size", 3)
    assert "cp_kv_cache_interleave_size=3: the interleave must divide the KV block size 16" in _refused(vllm_config)
    # vLLM accepts DCP 2 where each of 2 KV heads has 3 replicas; the 3 cannot hold whole sets of 2 shares
    gqa = make_vllm_config(
        parallel_kwargs=parallel_kwargs(tp=6),
        model_kwargs={"hf_overrides": {"num_attention_heads": 12}},
        max_model_len=128,
    )
    assert "tensor_parallel_size // num_kv_heads (3) must be a multiple of 2" in _refused(gqa)
    assert not doubles.schedulers
