"""A tiny engine stand-in that drives the connector hooks in vLLM's order over real torch
caches: `compute` of a block writes a value derived from (block hash, layer) into it, so a
loaded block can be checked byte for byte."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from layerkv.config import LayerKVConfig
from layerkv.connector import SchedulerConnector, WorkerConnector
from layerkv.messages import Deployment, KVRole, RequestView, ScheduledRequest, SchedulerStep, WorkerReport
from layerkv.store.base import KVStore

BLOCK_SIZE = 4


def chain_hashes(tokens: list[int], salt: bytes = b"") -> tuple[bytes, ...]:
    out, parent = [], salt
    for start in range(0, len(tokens) - len(tokens) % BLOCK_SIZE, BLOCK_SIZE):
        parent = hashlib.sha256(parent + bytes(str(tokens[start : start + BLOCK_SIZE]), "ascii")).digest()
        out.append(parent)
    return tuple(out)


def fill_value(block_hash: bytes, layer_idx: int) -> float:
    return float(int.from_bytes(block_hash[:2], "big") % 997 + layer_idx * 1000 + 1)


@dataclass
class Req:
    req_id: str
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    def view(self) -> RequestView:
        return RequestView(self.req_id, len(self.tokens), len(self.tokens), chain_hashes(self.tokens))


class Rig:
    """One scheduler connector and `tp_size` worker connectors over one store."""

    def __init__(self, store_factory, *, num_layers: int = 3, num_blocks: int = 64, num_kv_heads: int = 2,
                 tp_size: int = 1, role: KVRole = KVRole.BOTH, config: LayerKVConfig | None = None) -> None:
        self.config = config or LayerKVConfig.from_dict({}, env={})
        self.num_layers, self.num_blocks, self.tp_size = num_layers, num_blocks, tp_size
        heads_per_rank = max(1, num_kv_heads // tp_size)
        base = Deployment(model_id="test/rig-model", kv_dtype="float32", block_size=BLOCK_SIZE,
                          num_kv_heads=num_kv_heads, tp_size=tp_size, role=role,
                          kv_signature=f"rig:{num_layers}x[2,{BLOCK_SIZE},{heads_per_rank},8]f32")
        self.scheduler = SchedulerConnector(self.config, base, store_factory())
        self.workers: list[WorkerConnector] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp_size):
            worker = WorkerConnector(self.config, _rank(base, rank), store_factory())
            caches = {f"model.layers.{l}.self_attn.attn": torch.zeros(2, num_blocks, BLOCK_SIZE, heads_per_rank, 8)
                      for l in range(num_layers)}  # [2, num_blocks, block_size, heads, head_dim]
            worker.register_kv_caches(caches, num_blocks)
            self.workers.append(worker)
            self.caches.append(caches)
        self.next_block = 0
        self.invalid: set[int] = set()

    def layer_name(self, layer_idx: int) -> str:
        return f"model.layers.{layer_idx}.self_attn.attn"

    def admit(self, req: Req, budget: int | None = None) -> tuple[int, ScheduledRequest]:
        """Schedule a new request: pool lookup, allocation, first chunk of at most `budget` tokens."""
        view = req.view()
        ext, load_async = self.scheduler.get_num_new_matched_tokens(view, 0)
        assert load_async is False
        num_blocks_needed = -(-len(req.tokens) // BLOCK_SIZE)
        req.block_ids = list(range(self.next_block, self.next_block + num_blocks_needed))
        self.next_block += num_blocks_needed
        self.scheduler.update_state_after_alloc(view, tuple(req.block_ids), ext)
        req.num_computed = ext
        return ext, self.chunk(req, budget)

    def chunk(self, req: Req, budget: int | None = None) -> ScheduledRequest:
        remaining = len(req.tokens) - req.num_computed
        n = remaining if budget is None else min(budget, remaining)
        return ScheduledRequest(req.req_id, tuple(req.block_ids), req.num_computed, n, req.view().block_hashes)

    def step(self, scheduled: list[ScheduledRequest], *, finished: frozenset[str] = frozenset(),
             layers: int | None = None) -> set[int]:
        """Run one engine step; returns the invalid block ids the workers reported."""
        plan = self.scheduler.build_connector_meta(SchedulerStep(tuple(scheduled), finished_req_ids=finished))
        for worker in self.workers:
            worker.bind_connector_metadata(plan)
            worker.start_load_kv()
        for layer_idx in range(self.num_layers if layers is None else layers):
            for rank, worker in enumerate(self.workers):
                worker.wait_for_layer_load(self.layer_name(layer_idx))
                self._compute_layer(rank, layer_idx, scheduled)
                worker.save_kv_layer(self.layer_name(layer_idx))
        invalid: set[int] = set()
        for worker in self.workers:
            worker.wait_for_save()
            worker.get_finished(set(finished))
            invalid |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
        self.scheduler.update_connector_output(WorkerReport(invalid_block_ids=frozenset(invalid)))
        self.invalid |= invalid
        return invalid

    def _compute_layer(self, rank: int, layer_idx: int, scheduled: list[ScheduledRequest]) -> None:
        cache = self.caches[rank][self.layer_name(layer_idx)]
        for s in scheduled:
            first, last = s.num_computed_tokens // BLOCK_SIZE, -(-(s.num_computed_tokens + s.num_scheduled_tokens) // BLOCK_SIZE)
            for block in range(first, min(last, len(s.block_hashes))):
                cache[:, s.block_ids[block]] = fill_value(s.block_hashes[block], layer_idx) + rank * 0.5

    def expected_block(self, rank: int, layer_idx: int, block_hash: bytes) -> float:
        return fill_value(block_hash, layer_idx) + rank * 0.5

    def block_values(self, rank: int, layer_idx: int, block_id: int) -> torch.Tensor:
        return self.caches[rank][self.layer_name(layer_idx)][:, block_id]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def _rank(base: Deployment, rank: int) -> Deployment:
    import dataclasses

    return dataclasses.replace(base, tp_rank=rank)
