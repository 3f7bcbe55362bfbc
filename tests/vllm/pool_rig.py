"""Real-connector rig for tests/vllm: a "node" is vLLM's real Scheduler plus one worker-role
facade on CPU caches in vLLM's layout, both built by vLLM's connector factory over the REAL
layerkv core and a real store (the process-wide embedded store, or a real mooncake_master).
The stand-in model writes deterministic KV rows (a function of layer, position and token) for
the tokens vLLM schedules, so a block's expected bytes are known without running a model.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layerkv.bench.decode.engine import runner_output
from tests.vllm.vllm_harness import BLOCK_SIZE, LAYERS, Engine, make_engine, make_request
from tests.vllm.worker_rig import WorkerRig, make_worker

SAMPLED_TOKEN = 7  # what runner_output samples for every request
_tenants = itertools.count()


def kv_rows(layer_idx: int, positions: torch.Tensor, tokens: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """The stand-in model's KV for (positions, tokens) of one layer: [T, heads, width] float16,
    exact in float16 (multiples of 0.25 below 512)."""
    base = (layer_idx * 131 + positions * 7 + tokens) % 251  # [T]
    offsets = torch.arange(heads * width, dtype=torch.float32).view(heads, width) % 64 * 0.25  # [H, C]
    return (base.view(-1, 1, 1).to(torch.float32) + offsets).to(torch.float16)


def expected_block(layer_idx: int, tokens: list[int], block_idx: int, like: torch.Tensor) -> torch.Tensor:
    """What block `block_idx` of a request with `tokens` holds in one layer: [H, N, C]."""
    num_heads, _, width = like.shape
    positions = torch.arange(block_idx * BLOCK_SIZE, (block_idx + 1) * BLOCK_SIZE)
    rows = kv_rows(layer_idx, positions, torch.tensor(tokens)[positions], num_heads, width)  # [N, H, C]
    return rows.permute(1, 0, 2).contiguous()


@dataclass
class _Tracked:
    tokens: list[int]
    block_ids: list[int]


class StandInModel:
    """Tracks what a model runner tracks (per request: tokens, block ids) from SchedulerOutput
    and writes each scheduled token's KV into the layer's cache when that layer 'runs'."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self._requests: dict[str, _Tracked] = {}
        self._writes: list[tuple[str, int, int]] = []  # this step: (req_id, first, last) positions

    def begin_step(self, out: Any) -> None:
        self._writes = []
        for new in out.scheduled_new_reqs:  # new, or resumed (0.34: prefill_token_ids = prompt + generated)
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
            self._requests[new.req_id] = _Tracked(list(tokens), list(new.block_ids[0]))
            self._writes.append((new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in getattr(cached, "resumed_req_ids", ()):  # vLLM 0.33's model runner V1 only
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._writes.append((req_id, cached.num_computed_tokens[i], out.num_scheduled_tokens[req_id]))
        for req_id in out.finished_req_ids:
            self._requests.pop(req_id, None)

    def run_layer(self, layer_name: str) -> None:
        cache = self.kv_caches[layer_name]  # [num_blocks, H, N, C]
        layer_idx = LAYERS.index(layer_name)
        for req_id, first, count in self._writes:
            tracked = self._requests[req_id]
            positions = torch.arange(first, first + count)
            tokens = [tracked.tokens[p] if p < len(tracked.tokens) else SAMPLED_TOKEN for p in positions.tolist()]
            rows = kv_rows(layer_idx, positions, torch.tensor(tokens), cache.shape[1], cache.shape[3])  # [T, H, C]
            blocks = torch.tensor(tracked.block_ids)[positions // BLOCK_SIZE]
            cache[blocks, :, positions % BLOCK_SIZE, :] = rows


@dataclass
class Node:
    """One vLLM instance: real Scheduler + worker facade + stand-in model."""

    engine: Engine
    worker: WorkerRig
    model: StandInModel
    closed: bool = False
    outputs: list[Any] = field(default_factory=list)  # KVConnectorOutput per step

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    @property
    def core_worker(self) -> Any:
        """The neutral worker connector of the (single) KV cache group."""
        (worker,) = self.worker.connector.worker_side.subs
        return worker

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Any:
        request = make_request(req_id, tokens, max_tokens=max_tokens)
        self.scheduler.add_request(request)
        return request

    def step(self, on_layer: Callable[[str], None] | None = None) -> tuple[Any, Any, Any]:
        """schedule -> worker step (real hook path) -> update_from_output."""
        out = self.scheduler.schedule()
        self.model.begin_step(out)

        def layer(name: str) -> None:
            if on_layer is not None:
                on_layer(name)
            self.model.run_layer(name)

        connector_output = self.worker.run_step(out, layer)
        self.outputs.append(connector_output)
        engine_outputs = self.scheduler.update_from_output(out, runner_output(self.scheduler, out, connector_output))
        return out, connector_output, engine_outputs

    def run_to_completion(self, max_steps: int = 200) -> int:
        for num_steps in range(1, max_steps + 1):
            self.step()
            if not self.scheduler.has_requests():  # what vLLM's EngineCore busy loop checks
                assert self.core_worker.flush(5.0), "background writes / commits did not finish"
                return num_steps
        raise AssertionError(f"requests still running after {max_steps} steps: {list(self.scheduler.requests)}")

    def block_ids(self, req_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    def block(self, layer_name: str, block_id: int) -> torch.Tensor:
        return self.worker.kv_caches[layer_name][block_id].clone()

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.connector.shutdown()
            self.scheduler.shutdown()


class PoolNodes:
    """Builds nodes that share one pool (`backend`: "embedded" or "mooncake") under a tenant
    unique to the test; `shutdown()` closes every node (and the shared embedded stores)."""

    def __init__(self, backend: str, tmp_path: Path, master: Any = None) -> None:
        self.backend = backend
        self.extra: dict[str, Any] = {"tenant": f"vllm-test-{next(_tenants)}"}
        if backend == "mooncake":
            path = tmp_path / "mooncake.json"
            path.write_text(json.dumps(master.config()))
            self.extra.update(backend="mooncake", mooncake_config_path=str(path))
        self.nodes: list[Node] = []

    def node(self, num_blocks: int = 64, *, extra: dict | None = None, **config_kwargs: Any) -> Node:
        engine = make_engine(num_blocks, extra={**self.extra, **(extra or {})}, **config_kwargs)
        worker = make_worker(engine)
        node = Node(engine, worker, StandInModel(worker.kv_caches))
        self.nodes.append(node)
        return node

    def shutdown(self) -> None:
        from layerkv.store.process_stores import close_shared_stores

        # in parallel: closing a Mooncake client takes 1-2 s, and every node has two
        with ThreadPoolExecutor(max_workers=max(1, len(self.nodes))) as pool:
            list(pool.map(lambda node: node.shutdown(), self.nodes))
        alive = [name for node in self.nodes for name in node.core_worker.threads_alive()]
        assert not alive, f"transfer threads still alive after shutdown: {alive}"
        if self.backend == "embedded":
            close_shared_stores()


def produce(pool, req_id: str, tokens: list[int], **node_kwargs):
    """A producer node computes `tokens` to completion; returns its per-block bytes (by hash)."""
    producer = pool.node(**node_kwargs)
    request = producer.add(req_id, tokens)
    saved: dict[bytes, dict[str, torch.Tensor]] = {}

    def keep_blocks(_name: str) -> None:
        ids = producer.block_ids(req_id) if req_id in producer.scheduler.requests else []
        for i, block_hash in enumerate(request.block_hashes[: len(ids)]):
            saved.setdefault(block_hash, {})
            for name in LAYERS:
                saved[block_hash][name] = producer.block(name, ids[i])

    producer.step()
    keep_blocks("")
    while producer.scheduler.has_requests():  # what vLLM's EngineCore busy loop checks
        producer.step()
        keep_blocks("")
    assert producer.core_worker.flush(5.0)  # background writes and commits done: the pool serves them
    return producer, request, saved


def assert_blocks(node, req_id: str, tokens: list[int], num_blocks: int, saved=None, request=None) -> None:
    ids = node.block_ids(req_id)
    for name in LAYERS:
        for b in range(num_blocks):
            got = node.block(name, ids[b])
            want = expected_block(LAYERS.index(name), tokens, b, got)
            assert torch.equal(got, want), f"{name} block {b}: cache differs from the stand-in model"
            if saved is not None:
                assert torch.equal(got, saved[request.block_hashes[b]][name]), (
                    f"{name} block {b} differs from the producer"
                )
