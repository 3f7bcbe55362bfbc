"""A tiny engine stand-in that drives the connector hooks in vLLM's order over real torch
caches: `compute` of a block writes a value derived from (block hash, layer, rank) into it, so a
loaded block can be checked byte for byte. Each connector gets its own store client wrapped as
CheckedStore(FaultyStore(client)); tests add fault rules to `rig.faults[rank]` / `rig.sched_faults`."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from layerkv.config import LayerKVConfig
from layerkv.connector import SchedulerConnector, WorkerConnector
from layerkv.messages import Deployment, KVRole, RequestView, ScheduledRequest, SchedulerStep, WorkerReport
from layerkv.objects.keys import block_keys
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import GET_END, GET_RANGES, GET_START, FaultyStore

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

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return chain_hashes(self.tokens)

    @property
    def done(self) -> bool:
        return self.num_computed >= len(self.tokens)


def _rig_config(config: dict[str, Any]) -> LayerKVConfig:
    """Short transfer timeouts; the per-layer plan unless a test asks for another (most tests pin
    per-layer behaviour), straight into a registered cache (register_kv_cache) unless a test
    asks for staging."""
    plan = "groups" if config.get("read_layers_per_range", 1) > 1 else "layers"
    direct = config.get("transfer_plan", plan) == "layers"
    return LayerKVConfig.from_dict(
        {"load_timeout_s": 5.0, "save_timeout_s": 5.0, "transfer_plan": plan, "register_kv_cache": direct, **config},
        env={},
    )


class Rig:
    """One scheduler connector and `tp_size` worker connectors over one test backend."""

    def __init__(
        self,
        backend: Any,
        *,
        num_layers: int = 3,
        num_blocks: int = 64,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        tp_size: int = 1,
        role: KVRole = KVRole.BOTH,
        call_save: bool = True,
        first_layer: int = 0,
        window_blocks: int = 0,
        **config: Any,
    ) -> None:
        # first_layer / window_blocks: this rig is one KV cache group of a hybrid model (its
        # layers are the model's first_layer.., a sliding-window group when window_blocks > 0)
        self.first_layer = first_layer
        self.config = _rig_config(config)
        self.backend = backend
        self.num_layers, self.num_blocks, self.tp_size, self.call_save = num_layers, num_blocks, tp_size, call_save
        heads_per_rank = max(1, num_kv_heads // tp_size)
        self.deployment = Deployment(
            model_id=f"test/rig-{backend.tag}",
            kv_dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_heads=num_kv_heads,
            tp_size=tp_size,
            role=role,
            kv_signature=f"rig:{num_layers}x[2,{BLOCK_SIZE},{heads_per_rank},{head_dim}]f32"
            + (f"@{first_layer}" if first_layer else ""),
            window_blocks=window_blocks,
        )
        self.sched_faults = FaultyStore(backend.client())
        self.scheduler = SchedulerConnector(self.config, self.deployment, self._checked(self.sched_faults))
        self.faults: list[FaultyStore] = []
        self.checked: list[CheckedStore] = []
        self.workers: list[WorkerConnector] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp_size):
            self._open_worker(rank, heads_per_rank, head_dim)
        self.next_block = 0
        self.reqs: dict[str, Req] = {}
        self.finished: set[str] = set()

    def _open_worker(self, rank: int, heads_per_rank: int, head_dim: int) -> None:
        """Rank `rank`'s worker connector over its own store client, its caches registered."""
        faulty = FaultyStore(self.backend.client())
        checked = self._checked(faulty)
        worker = WorkerConnector(self.config, dataclasses.replace(self.deployment, tp_rank=rank), checked)
        caches = {
            self.layer_name(li): torch.zeros(2, self.num_blocks, BLOCK_SIZE, heads_per_rank, head_dim)
            for li in range(self.num_layers)
        }  # [2, num_blocks, block_size, heads, head_dim]
        worker.register_kv_caches(caches, self.num_blocks)
        self.faults.append(faulty)
        self.checked.append(checked)
        self.workers.append(worker)
        self.caches.append(caches)

    def _checked(self, faulty: FaultyStore) -> CheckedStore:
        """As layerkv opens its store: chunked, bounded metadata calls, outage short-circuit."""
        return CheckedStore(
            faulty,
            max_batch_keys=self.config.max_transfer_blocks,
            retry_interval_s=self.config.store_retry_interval_s,
            call_timeout_s=self.config.store_call_timeout_s,
        )

    def layer_name(self, layer_idx: int) -> str:
        return f"model.layers.{self.first_layer + layer_idx}.self_attn.attn"

    def keys(self, req: Req, rank: int = 0, blocks: range | list[int] | None = None) -> list[str]:
        """Object keys of `req`'s full blocks on storage rank `rank`."""
        hashes = req.hashes
        picked = [hashes[i] for i in (range(len(hashes)) if blocks is None else blocks)]
        return block_keys(self.scheduler.namespace, picked, rank)

    # -- scheduling ----------------------------------------------------------------------------
    def admit(self, req: Req, budget: int | None = None) -> tuple[int, ScheduledRequest]:
        """Schedule a new (or resumed) request: pool lookup, allocation, first chunk of at most
        `budget` tokens. Returns (tokens the pool provides, the scheduled request)."""
        view = req.view()
        ext, load_async = self.scheduler.get_num_new_matched_tokens(view, 0)
        assert load_async is False
        num_blocks_needed = -(-len(req.tokens) // BLOCK_SIZE)
        req.block_ids = list(range(self.next_block, self.next_block + num_blocks_needed))
        self.next_block += num_blocks_needed
        assert self.next_block <= self.num_blocks, "rig out of blocks"
        self.scheduler.update_state_after_alloc(view, tuple(req.block_ids), ext)
        req.num_computed = ext
        self.reqs[req.req_id] = req
        return ext, self.chunk(req, budget, resumed=False)

    def chunk(self, req: Req, budget: int | None = None, *, resumed: bool = False) -> ScheduledRequest:
        remaining = len(req.tokens) - req.num_computed
        n = remaining if budget is None else min(budget, remaining)
        return ScheduledRequest(req.req_id, tuple(req.block_ids), req.num_computed, n, req.hashes, resumed)

    def worker_step(
        self, scheduled: list[ScheduledRequest], *, deferred: bool = False
    ) -> tuple[set[int], tuple[int, ...]]:
        """One step of rank 0 in vLLM's hook order; `deferred`: the order vLLM uses with
        speculative decoding (load errors and the step report before wait_for_save). Returns
        (invalid blocks, reported steps); the scheduler side gets them as vLLM would pass them."""
        worker = self.workers[0]
        plan = self.scheduler.build_connector_meta(self.step_of(scheduled))
        worker.bind_connector_metadata(plan)
        worker.start_load_kv()
        for layer_idx in range(self.num_layers):
            worker.wait_for_layer_load(self.layer_name(layer_idx))
            self._compute_layer(0, layer_idx, scheduled)
            worker.save_kv_layer(self.layer_name(layer_idx))
        if not deferred:
            worker.wait_for_save()
        invalid, steps = worker.get_block_ids_with_load_errors(), worker.report_steps()
        if deferred:
            worker.wait_for_save()
        worker.clear_connector_metadata()
        self.scheduler.update_connector_output(WorkerReport(invalid_block_ids=frozenset(invalid), reported_steps=steps))
        return invalid, steps

    def step(
        self,
        scheduled: list[ScheduledRequest],
        *,
        finished: frozenset[str] = frozenset(),
        preempted: frozenset[str] = frozenset(),
        layers: int | None = None,
    ) -> set[int]:
        """Run one engine step; returns the invalid block ids the workers reported. Requests
        with invalid blocks are rewound to their first invalid block (vLLM's recompute)."""
        plan = self.scheduler.build_connector_meta(self.step_of(scheduled, finished, preempted))
        for worker in self.workers:
            worker.bind_connector_metadata(plan)
            worker.start_load_kv()
        for layer_idx in range(self.num_layers if layers is None else layers):
            for rank, worker in enumerate(self.workers):
                worker.wait_for_layer_load(self.layer_name(layer_idx))
                self._compute_layer(rank, layer_idx, scheduled)
                if self.call_save:
                    worker.save_kv_layer(self.layer_name(layer_idx))
        return self.end_step(scheduled, finished)

    @staticmethod
    def step_of(
        scheduled: list[ScheduledRequest],
        finished: frozenset[str] = frozenset(),
        preempted: frozenset[str] = frozenset(),
    ) -> SchedulerStep:
        return SchedulerStep(tuple(scheduled), finished_req_ids=finished, preempted_req_ids=preempted)

    def end_step(self, scheduled: list[ScheduledRequest], finished: frozenset[str] = frozenset()) -> set[int]:
        invalid: set[int] = set()
        reported: list[int] = []
        for worker in self.workers:
            worker.wait_for_save()
            worker.get_finished(set(finished))
            invalid |= worker.get_block_ids_with_load_errors()
            reported.extend(worker.report_steps())
            worker.clear_connector_metadata()
        self.scheduler.update_connector_output(
            WorkerReport(invalid_block_ids=frozenset(invalid), reported_steps=tuple(reported))
        )
        for s in scheduled:
            req = self.reqs[s.req_id]
            req.num_computed = s.num_computed_tokens + s.num_scheduled_tokens
            bad = [i for i, b in enumerate(req.block_ids) if b in invalid]
            if bad:
                req.num_computed = min(req.num_computed, bad[0] * BLOCK_SIZE)
        return invalid

    def run(self, req: Req, budget: int | None = None) -> tuple[int, set[int]]:
        """Admit `req` and step it until its prompt is computed, then one empty step that carries
        the verdicts on its saves (commits happen a step later); (pool tokens, invalid blocks)."""
        ext, s = self.admit(req, budget)
        invalid = self.step([s])
        while not req.done:
            invalid |= self.step([self.chunk(req, budget)])
        self.settle()
        return ext, invalid

    def settle(self) -> None:
        """An engine step with nothing scheduled: delivers the verdicts on earlier saves; then
        waits for the background writes and commits."""
        self.step([])
        self.flush()

    def flush(self) -> None:
        for worker in self.workers:
            assert worker.flush(5.0), "background transfers did not finish"

    def finish(self, *reqs: Req) -> None:
        """The requests end: request_finished on the scheduler, then a step that carries the ids."""
        ids = frozenset(r.req_id for r in reqs)
        for req in reqs:
            self.scheduler.request_finished(req.view(), tuple(req.block_ids))
        self.finished |= ids
        self.step([], finished=ids)

    def drain(self) -> None:
        """Finish every request still known (teardown)."""
        left = [r for rid, r in self.reqs.items() if rid not in self.finished]
        self.finish(*left)

    def _compute_layer(self, rank: int, layer_idx: int, scheduled: list[ScheduledRequest]) -> None:
        cache = self.caches[rank][self.layer_name(layer_idx)]
        for s in scheduled:
            first = s.num_computed_tokens // BLOCK_SIZE
            last = -(-(s.num_computed_tokens + s.num_scheduled_tokens) // BLOCK_SIZE)
            for block in range(first, min(last, len(s.block_hashes))):
                cache[:, s.block_ids[block]] = self.expected_block(rank, layer_idx, s.block_hashes[block])

    # -- checks --------------------------------------------------------------------------------
    def expected_block(self, rank: int, layer_idx: int, block_hash: bytes) -> float:
        return fill_value(block_hash, self.first_layer + layer_idx) + rank * 0.5

    def block_values(self, rank: int, layer_idx: int, block_id: int) -> torch.Tensor:
        return self.caches[rank][self.layer_name(layer_idx)][:, block_id]

    def wrong_blocks(self, req: Req, blocks: range | list[int]) -> list[tuple[int, int, int]]:
        """(rank, layer, block index) of `req`'s blocks whose bytes are not what compute writes."""
        hashes = req.hashes
        return [
            (rank, layer, i)
            for rank in range(self.tp_size)
            for layer in range(self.num_layers)
            for i in blocks
            if not bool(
                (self.block_values(rank, layer, req.block_ids[i]) == self.expected_block(rank, layer, hashes[i])).all()
            )
        ]

    def pool_exists(self, keys: list[str]) -> list[int]:
        """The pool's exists answer for `keys`, past the scheduler side's fault rules and checks."""
        return self.sched_faults.inner.batch_is_exist(keys)

    def poison(self, req: Req) -> None:
        """Overwrite `req`'s local blocks so a later check proves they were loaded."""
        for caches in self.caches:
            for cache in caches.values():
                cache[:, req.block_ids] = -1.0

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def assert_get_sessions_well_formed(faulty) -> None:
    """Per key: start -> reads that all returned -> exactly one end, before any new start."""
    calls = sorted(faulty.calls(), key=lambda c: c.enter_seq)
    open_since: dict[str, int] = {}  # key -> start's exit seq
    last_read_exit: dict[str, int] = {}
    for c in calls:
        for key in c.keys:
            if c.method == GET_START:
                assert key not in open_since, f"second get start on open session {key}"
                open_since[key] = c.exit_seq
            elif c.method == GET_RANGES:
                assert key in open_since, f"read of {key} outside a session"
                last_read_exit[key] = max(last_read_exit.get(key, -1), c.exit_seq)
            elif c.method == GET_END:
                assert key in open_since, f"get end of {key} without an open session (twice?)"
                assert last_read_exit.get(key, -1) < c.enter_seq, f"get end of {key} while a read was in flight"
                del open_since[key]
                last_read_exit.pop(key, None)
    assert not open_since, f"get sessions never ended: {sorted(open_since)[:3]}"
