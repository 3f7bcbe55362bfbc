"""The pool's events (connector/events.py) as vLLM KV cache events, which vLLM's publisher
(`--kv-events-config`) carries to KV-aware routers next to the engine's own: `BlockStored`
(medium "STORAGE", locality "REMOTE": the pool, not this engine's memory) once a block's objects
are committed, `BlockRemoved` when a load of it failed, `AllBlocksCleared` at a cache reset.
The token ids of a block are noted when its save is planned (by its verdict, a step later, the
request may be gone). Scheduler side, scheduler thread only; only when vLLM publishes events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash as VllmBlockHash
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import layerkv.integrations.vllm.version  # noqa: F401  (refuses an unsupported vLLM first)
from layerkv.connector.events import PoolEvent, PoolEventKind
from layerkv.messages import BlockHash, ReqId

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Blocks noted and not yet announced (a step whose verdict never comes is revoked: its notes
# age out, oldest first).
MAX_NOTED_BLOCKS = 1 << 16
LOCALITY = "REMOTE"


def _external(block_hash: BlockHash) -> Any:
    """vLLM's event form of a block hash (bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return maybe_convert_block_hash(VllmBlockHash(block_hash))


class _Noted:
    __slots__ = ("token_ids", "parent", "lora_id", "lora_name", "session_id")

    def __init__(self, request: Request, index: int, block_size: int) -> None:
        self.token_ids = list(request.all_token_ids[index * block_size : (index + 1) * block_size])
        self.parent = request.block_hashes[index - 1] if index > 0 else None
        lora = getattr(request, "lora_request", None)
        self.lora_id = lora.adapter_id if lora is not None else None
        self.lora_name = lora.name if lora is not None else None
        self.session_id = getattr(request, "session_id", None)


class VllmPoolEvents:
    """Notes planned saves (`note`) and turns the core's events into vLLM's (`events`)."""

    def __init__(self, block_size: int) -> None:
        # tokens per block hash: the engine block (block_size x decode_context_parallel_size), as
        # vLLM's own BlockStored events count it
        self._block_size = block_size
        self._noted: OrderedDict[tuple[int, BlockHash], _Noted] = OrderedDict()  # (group, hash) -> its tokens

    def note(self, plans: Sequence[Any], request_of: Callable[[ReqId], Request | None]) -> None:
        """Each group's plan (`plans[g]`, a StepPlan or None): its saves' blocks' tokens."""
        for group, plan in enumerate(plans):
            for spec in getattr(plan, "saves", ()):
                request = request_of(spec.req_id)
                if request is None:
                    continue
                index = {h: i for i, h in enumerate(request.block_hashes)}
                for block_hash in spec.block_hashes:
                    if block_hash in index:
                        self._noted[(group, block_hash)] = _Noted(request, index[block_hash], self._block_size)
        while len(self._noted) > MAX_NOTED_BLOCKS:
            self._noted.popitem(last=False)

    def events(self, pool_events: Sequence[tuple[int, PoolEvent]]) -> list[KVCacheEvent]:
        """vLLM's events for (group index, PoolEvent) pairs; a stored block one event each (its
        parent is the block before it in its request, whatever the pool holds of that)."""
        out: list[KVCacheEvent] = []
        for group, event in pool_events:
            if event.kind is PoolEventKind.CLEARED:
                self._noted.clear()
                out.append(AllBlocksCleared())
            elif event.kind is PoolEventKind.REMOVED:
                out.append(
                    BlockRemoved(
                        block_hashes=[_external(h) for h in event.block_hashes],
                        medium=MEDIUM_STORAGE,
                        group_idx=group,
                        locality=LOCALITY,
                    )
                )
            else:
                out.extend(self._stored(group, event.block_hashes))
        return out

    def _stored(self, group: int, hashes: Sequence[BlockHash]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for block_hash in hashes:
            noted = self._noted.pop((group, block_hash), None)
            if noted is None:  # aged out: a router cannot place it without its tokens
                continue
            out.append(
                BlockStored(
                    block_hashes=[_external(block_hash)],
                    parent_block_hash=_external(noted.parent) if noted.parent is not None else None,
                    token_ids=noted.token_ids,
                    block_size=self._block_size,
                    lora_id=noted.lora_id,
                    medium=MEDIUM_STORAGE,
                    lora_name=noted.lora_name,
                    group_idx=group,
                    locality=LOCALITY,
                    session_id=noted.session_id,
                )
            )
        return out
