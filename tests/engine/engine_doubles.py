"""Test doubles of the connector hooks for the reference engine: a recorder of hook calls, and
a 'pool' that copies KV bytes from another engine's caches (optionally failing some blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from layerkv.connector.hooks import NullScheduler, NullWorker
from layerkv.messages import RequestView, SchedulerStep, WorkerReport


class RecordingScheduler(NullScheduler):
    def __init__(self, calls: list[tuple[str, str, Any]]) -> None:
        self.calls = calls

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("sched", "get_num_new_matched_tokens", (request.req_id, num_computed_tokens)))
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[int, ...], num_external_tokens: int
    ) -> None:
        self.calls.append(("sched", "update_state_after_alloc", (request.req_id, num_external_tokens)))

    def build_connector_meta(self, step: SchedulerStep) -> Any:
        self.calls.append(("sched", "build_connector_meta", step))
        return ("meta", len(self.calls))

    def update_connector_output(self, report: WorkerReport) -> None:
        self.calls.append(("sched", "update_connector_output", report))

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("sched", "request_finished", request.req_id))
        return False, None

    def has_pending_work(self) -> bool:
        return False


class RecordingWorker(NullWorker):
    def __init__(self, rank: int, calls: list[tuple[str, str, Any]]) -> None:
        self.who, self.calls = f"w{rank}", calls

    def _rec(self, name: str, arg: Any = None) -> None:
        self.calls.append((self.who, name, arg))

    def register_kv_caches(self, kv_caches, num_blocks):  # type: ignore[no-untyped-def]
        self._rec("register_kv_caches", (tuple(kv_caches), num_blocks))

    def bind_connector_metadata(self, meta):  # type: ignore[no-untyped-def]
        self._rec("bind_connector_metadata", meta)

    def start_load_kv(self):  # type: ignore[no-untyped-def]
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name):  # type: ignore[no-untyped-def]
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name):  # type: ignore[no-untyped-def]
        self._rec("save_kv_layer", layer_name)

    def wait_for_save(self):  # type: ignore[no-untyped-def]
        self._rec("wait_for_save")

    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        self._rec("get_finished", frozenset(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self):  # type: ignore[no-untyped-def]
        self._rec("get_block_ids_with_load_errors")
        return set()

    def clear_connector_metadata(self):  # type: ignore[no-untyped-def]
        self._rec("clear_connector_metadata")

    def shutdown(self):  # type: ignore[no-untyped-def]
        self._rec("shutdown")


@dataclass
class CopyPlan:
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source block id, local block id)


class CopyScheduler(NullScheduler):
    """Offers every leading block the source engine has in its prefix cache (keeping the last
    token for the engine), and plans byte copies of those blocks into the allocated local ones."""

    def __init__(self, source_engine: Any, block_size: int, max_blocks: int = 1 << 30) -> None:
        self.source, self.block_size, self.max_blocks = source_engine, block_size, max_blocks
        self._pending: list[tuple[int, int]] = []
        self._offers: dict[str, tuple[int, list[int]]] = {}
        self.reports: list[WorkerReport] = []

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        pool = self.source.scheduler.block_pool
        first = num_computed_tokens // self.block_size
        max_blocks = min((request.num_tokens - 1) // self.block_size, self.max_blocks)
        src: list[int] = []
        for block_hash in request.block_hashes[first:max_blocks]:
            block_id = pool.cached_block_id(block_hash)
            if block_id is None:
                break
            src.append(block_id)
        self._offers[request.req_id] = (first, src)
        return len(src) * self.block_size, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[int, ...], num_external_tokens: int
    ) -> None:
        first, src = self._offers.pop(request.req_id)  # external blocks follow the local hit
        num_ext_blocks = num_external_tokens // self.block_size
        self._pending.extend(zip(src[:num_ext_blocks], block_ids[first : first + num_ext_blocks]))

    def build_connector_meta(self, step: SchedulerStep) -> CopyPlan:
        plan, self._pending = CopyPlan(list(self._pending)), []
        return plan

    def update_connector_output(self, report: WorkerReport) -> None:
        self.reports.append(report)


class CopyWorker(NullWorker):
    """Copies planned blocks byte-for-byte from the source rank's caches, one layer at a time in
    wait_for_layer_load. Blocks at positions `fail_copy_idx` of the first plan with copies are
    filled with garbage instead and reported as load errors."""

    def __init__(
        self, source_caches: dict[str, torch.Tensor], fail_copy_idx: frozenset[int] = frozenset(), corrupt: str = ""
    ) -> None:
        self.source = source_caches
        self.fail_copy_idx = fail_copy_idx
        self.corrupt = corrupt  # cache names containing this get wrong bytes (tests that they matter)
        self.caches: dict[str, torch.Tensor] = {}
        self.plan: CopyPlan | None = None
        self.failed_once = False
        self._errors: set[int] = set()
        self.layers_loaded: list[str] = []

    def register_kv_caches(self, kv_caches, num_blocks):  # type: ignore[no-untyped-def]
        self.caches = dict(kv_caches)

    def bind_connector_metadata(self, meta):  # type: ignore[no-untyped-def]
        self.plan = meta

    def wait_for_layer_load(self, layer_name):  # type: ignore[no-untyped-def]
        assert self.plan is not None
        fail = self.fail_copy_idx if (self.plan.copies and not self.failed_once) else frozenset()
        names = [
            n for n in self.caches if n == layer_name or n == layer_name.removesuffix(".attn") + ".indexer.k_cache"
        ]
        for idx, (src, dst) in enumerate(self.plan.copies):
            for name in names:
                dst_block, src_block = _block(self.caches[name], dst), _block(self.source[name], src)
                if idx in fail:
                    dst_block.fill_(7.0)  # garbage the engine must never use
                    self._errors.add(dst)
                else:
                    dst_block.copy_(src_block)
                    if self.corrupt and self.corrupt in name:
                        dst_block.add_(0.25)
        if self.plan.copies:
            self.layers_loaded.append(layer_name)

    def get_block_ids_with_load_errors(self):  # type: ignore[no-untyped-def]
        errors, self._errors = self._errors, set()
        return errors

    def clear_connector_metadata(self):  # type: ignore[no-untyped-def]
        if self.plan is not None and self.plan.copies and self.fail_copy_idx:
            self.failed_once = True
        self.plan = None


def _block(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """A view of one block: K/V caches [2, num_blocks, ...], flat caches [num_blocks, ...]."""
    return cache[:, block_id] if cache.dim() == 5 else cache[block_id]
