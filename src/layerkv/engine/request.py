"""A request's mutable state inside the reference engine (tokens, blocks, progress, timings)
and the immutable results handed to callers (RequestOutput, StepRecord). Scheduler side; touched
only by the engine's scheduler thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from layerkv.engine.hashing import extend_block_hashes
from layerkv.messages import BlockHash, ReqId, RequestView


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; recomputes from scratch
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        req_id: ReqId,
        prompt_token_ids: tuple[int, ...],
        max_tokens: int,
        salt: bytes,
        block_size: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> None:
        self.req_id = req_id
        self.kv_transfer_params = kv_transfer_params  # from the client (a prefill server's, via a proxy)
        self.finished_kv_transfer_params: dict[str, Any] | None = None  # the connector's, at the finish
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.salt = salt
        self.block_size = block_size  # tokens per engine block (one block hash; block_size * dcp_size per rank)
        self.output_token_ids: list[int] = []
        self.output_logits: list[torch.Tensor] = []
        self.draft_logits: list[torch.Tensor] = []  # MTP models: the draft layer's row per token
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_local_cached_tokens = -1  # local prefix hit when first scheduled
        self.num_external_tokens = 0  # total tokens loaded by the connector (all schedules)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.arrival_time_s = time.monotonic()
        self.first_token_time_s: float | None = None
        self.finish_time_s: float | None = None
        self._block_hashes: list[BlockHash] = []

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_hashes(self) -> tuple[BlockHash, ...]:
        extend_block_hashes(self._block_hashes, self.all_token_ids, self.block_size, self.salt)
        return tuple(self._block_hashes)

    def view(self) -> RequestView:
        return RequestView(
            req_id=self.req_id,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_tokens=self.num_tokens,
            block_hashes=self.block_hashes,
            kv_transfer_params=self.kv_transfer_params,
        )

    def to_output(self) -> RequestOutput:
        assert self.first_token_time_s is not None and self.finish_time_s is not None
        return RequestOutput(
            req_id=self.req_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=tuple(self.output_token_ids),
            logits=tuple(self.output_logits),
            draft_token_ids=tuple(int(torch.argmax(x)) for x in self.draft_logits),
            draft_logits=tuple(self.draft_logits),
            arrival_time_s=self.arrival_time_s,
            first_token_time_s=self.first_token_time_s,
            finish_time_s=self.finish_time_s,
            num_local_cached_tokens=max(self.num_local_cached_tokens, 0),
            num_external_tokens=self.num_external_tokens,
            num_preemptions=self.num_preemptions,
            kv_transfer_params=self.finished_kv_transfer_params,
        )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request. `logits[i]` is the float32 row [vocab_size] that produced token_ids[i]."""

    req_id: ReqId
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]
    arrival_time_s: float  # time.monotonic()
    first_token_time_s: float
    finish_time_s: float
    num_local_cached_tokens: int  # local prefix-cache hit at the first schedule
    num_external_tokens: int  # tokens whose KV the connector loaded (summed over schedules)
    num_preemptions: int
    # MTP models: the draft layer's prediction of the token after token_ids[i] (else empty)
    draft_token_ids: tuple[int, ...] = ()
    draft_logits: tuple[torch.Tensor, ...] = ()
    # what the connector returned at the finish (a prefill server's promise for a decode server)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_time_s - self.arrival_time_s


@dataclass(frozen=True, slots=True)
class StepRequestRecord:
    req_id: ReqId
    num_computed_tokens: int  # before the step's compute, incl. the tokens loaded in this step
    num_scheduled_tokens: int  # tokens computed in this step
    num_external_tokens: int  # tokens the connector loaded in this step
    resumed: bool


@dataclass(frozen=True, slots=True)
class StepRecord:
    step_idx: int
    requests: tuple[StepRequestRecord, ...]
    preempted_req_ids: frozenset[ReqId] = field(default_factory=frozenset)
    finished_req_ids: frozenset[ReqId] = field(default_factory=frozenset)  # finished by this step
    invalid_block_ids: frozenset[int] = field(default_factory=frozenset)
    discarded_req_ids: frozenset[ReqId] = field(default_factory=frozenset)  # output dropped (load errors)
    duration_s: float = 0.0
