"""The reference engine: a scheduler, a model runner with TP ranks in one process, and the
connector hooks called in vLLM's order. `Engine.generate` drives steps until every request is
done. Single-threaded: the caller's thread is both the scheduler and the compute thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerkv.connector.hooks import NullScheduler, NullWorker, SchedulerHooks, WorkerHooks
from layerkv.engine.context_parallel import check_dcp
from layerkv.engine.model import ModelConfig, Weights, check_tp, init_weights
from layerkv.engine.request import Request, RequestOutput, StepRecord, StepRequestRecord
from layerkv.engine.runner import ModelRunner
from layerkv.engine.scheduler import Scheduler
from layerkv.errors import ConfigError
from layerkv.messages import Deployment, KVRole, WorkerReport
from layerkv.objects.fingerprint import settings_digest


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 4  # tokens per KV cache block of one rank (an engine block: block_size * dcp_size)
    num_blocks: int = 64  # KV blocks per rank (the same block ids on every rank)
    max_num_batched_tokens: int = 64  # token budget per step
    max_num_seqs: int = 8  # running requests at most
    tp_size: int = 1
    pp_size: int = 1  # pipeline stages (each holds an even share of the layers)
    model_id: str = "layerkv/reference-llama"
    # Byte order of a K/V cache block: "NHD" [block_size, heads, head_dim] (vLLM's GPU default) or
    # "HND" [heads, block_size, head_dim] (vLLM's CPU default; a rank holding several shards of a
    # block, config store_shards, needs it). The tensors are [2, num_blocks, block_size, heads, head_dim] either way.
    kv_layout: str = "NHD"
    device: str = "cpu"  # where weights, KV caches and the forward live ("cuda", "cuda:1"; logits return to the host)
    # Decode context parallelism (vLLM's decode_context_parallel_size): each group of dcp_size consecutive
    # TP ranks caches an interleaved share of every engine block's tokens, runs of cp_interleave
    # tokens per rank in turn (vLLM's cp_kv_cache_interleave_size; it divides block_size)
    dcp_size: int = 1
    cp_interleave: int = 1

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "tp_size",
            "pp_size",
            "dcp_size",
            "cp_interleave",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"EngineConfig.{name}={value!r} must be a positive int")
        if self.kv_layout not in ("NHD", "HND"):
            raise ConfigError(f"EngineConfig.kv_layout={self.kv_layout!r} must be 'NHD' or 'HND'")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"EngineConfig.device={self.device!r} must be 'cpu' or 'cuda' ('cuda:N')")
        if self.tp_size % self.dcp_size:
            raise ConfigError(
                f"EngineConfig.dcp_size={self.dcp_size} must divide tp_size={self.tp_size} (DCP reuses the TP ranks)"
            )
        if self.block_size % self.cp_interleave:
            raise ConfigError(
                f"EngineConfig.cp_interleave={self.cp_interleave} must divide block_size={self.block_size}"
            )

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per engine block (what the scheduler allocates and one block hash covers)."""
        return self.block_size * self.dcp_size


def make_deployment(
    model_config: ModelConfig, engine_config: EngineConfig, tp_rank: int, role: KVRole = KVRole.BOTH, pp_rank: int = 0
) -> Deployment:
    """The Deployment a connector worker for (`tp_rank`, `pp_rank`) of this engine should be built with."""
    return Deployment(
        model_id=engine_config.model_id,
        kv_dtype=model_config.dtype,
        block_size=engine_config.block_size,
        num_kv_heads=1 if model_config.is_mla else model_config.num_kv_heads,
        tp_size=engine_config.tp_size,
        tp_rank=tp_rank,
        pp_size=engine_config.pp_size,
        pp_rank=pp_rank,
        model_fingerprint=f"seed={model_config.seed}",  # the weights are a function of the seed
        model_settings=settings_digest(dataclasses.asdict(model_config)),
        is_mla=model_config.is_mla,
        role=role,
        kv_signature=kv_signature(model_config, engine_config),
        dcp_size=engine_config.dcp_size,
        dcp_rank=tp_rank % engine_config.dcp_size,  # vLLM: DCP groups are consecutive TP ranks
        cp_interleave=engine_config.cp_interleave,
    )


def kv_signature(model_config: ModelConfig, engine_config: EngineConfig) -> str:
    """Per-layer cache shapes of the whole model (every KV head; the namespace adds the split and
    the DCP share), as the scheduler side can compute them (no tensors); block_size per rank."""
    m, bs = model_config, engine_config.block_size
    if m.is_mla:
        attn = f"mla[{bs},{m.mla_latent_dim}]"
    else:
        attn = f"kv[2,{bs},{m.num_kv_heads},{m.head_dim}]{engine_config.kv_layout}"  # every head: TP-independent
    index = f"+idx[{bs},{m.index_dim}]" if m.index_dim else ""
    return f"{m.num_layers}+{m.num_mtp_layers}mtp x {attn}{index} {m.dtype}"


class Engine:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig | None = None,
        scheduler_hooks: SchedulerHooks | None = None,
        worker_hooks: Sequence[WorkerHooks] | None = None,
        weights: Weights | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = engine_config = engine_config or EngineConfig()
        check_tp(model_config, engine_config.tp_size)
        check_dcp(model_config, engine_config.tp_size, engine_config.dcp_size)
        num_workers = engine_config.tp_size * engine_config.pp_size
        if worker_hooks is not None and len(worker_hooks) != num_workers:
            raise ConfigError(
                f"worker_hooks has {len(worker_hooks)} entries; tp_size={engine_config.tp_size} x "
                f"pp_size={engine_config.pp_size} needs one per (stage, rank)"
            )
        self.scheduler = Scheduler(
            scheduler_hooks or NullScheduler(),
            engine_config.num_blocks,
            engine_config.scheduler_block_size,
            engine_config.max_num_batched_tokens,
            engine_config.max_num_seqs,
        )
        self.runner = ModelRunner(
            model_config,
            weights if weights is not None else init_weights(model_config),
            engine_config.tp_size,
            engine_config.num_blocks,
            engine_config.block_size,
            worker_hooks or [NullWorker() for _ in range(num_workers)],
            engine_config.pp_size,
            kv_layout=engine_config.kv_layout,
            device=engine_config.device,
            dcp_size=engine_config.dcp_size,
            cp_interleave=engine_config.cp_interleave,
        )
        self.steps: list[StepRecord] = []  # every step since construction
        self._req_counter = itertools.count()
        self._closed = False

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.runner.layer_names

    def caches_for_rank(self, tp_rank: int, pp_rank: int = 0) -> dict[str, torch.Tensor]:
        """Cache name -> tensor (the live cache, not a copy), as given to register_kv_caches:
        attention layers [2, num_blocks, block_size, kv_heads_on_rank, head_dim] (MLA:
        [num_blocks, block_size, latent]), indexer caches [num_blocks, block_size, index_dim]."""
        return dict(self.runner.caches[pp_rank * self.config.tp_size + tp_rank].tensors)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int],
        salts: Sequence[bytes] | None = None,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion (greedy); outputs in prompt order. `kv_transfer_params`:
        per prompt, what a client sends along (a prefill server's output's, for a decode server)."""
        if self._closed:
            raise RuntimeError("Engine.generate after shutdown()")
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        salts = list(salts) if salts is not None else [b""] * len(prompts)
        params = list(kv_transfer_params) if kv_transfer_params is not None else [None] * len(prompts)
        if len(limits) != len(prompts) or len(salts) != len(prompts) or len(params) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts need as many max_tokens, salts and kv_transfer_params "
                f"({len(limits)}, {len(salts)}, {len(params)})"
            )
        requests = [self._make_request(p, m, s, k) for p, m, s, k in zip(prompts, limits, salts, params)]
        for request in requests:
            self.scheduler.add_request(request)
        while self.scheduler.has_work():
            self.step()
        for hooks in self.runner.worker_hooks:  # saves and commits done: the pool serves them now
            hooks.flush()
        return [r.to_output() for r in requests]

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        salt: bytes = b"",
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue one request (for driving `step()` by hand); returns its request id."""
        request = self._make_request(prompt, max_tokens, salt, kv_transfer_params)
        self.scheduler.add_request(request)
        return request.req_id

    def output(self, req_id: str) -> RequestOutput | None:
        """A request's output once it finished (None before): what a server would send the
        client at that moment (its saves may still be uncommitted: no flush)."""
        request = self.scheduler.requests.get(req_id)
        return request.to_output() if request is not None and request.finish_time_s is not None else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _make_request(
        self, prompt: Sequence[int], max_tokens: int, salt: bytes, kv_transfer_params: Mapping[str, Any] | None = None
    ) -> Request:
        vocab, cfg = self.model_config.vocab_size, self.config
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt must be non-empty token ids in [0, {vocab}); got {list(prompt)[:8]}...")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        num_blocks_needed = -(-(len(prompt) + max_tokens) // cfg.scheduler_block_size)
        if num_blocks_needed > cfg.num_blocks:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens + max_tokens={max_tokens} needs {num_blocks_needed} blocks; "
                f"num_blocks={cfg.num_blocks}"
            )
        return Request(
            f"req-{next(self._req_counter)}",
            tuple(prompt),
            max_tokens,
            salt,
            cfg.scheduler_block_size,
            kv_transfer_params,
        )

    def step(self) -> StepRecord:
        """One engine step: schedule, forward (with worker hooks), update (with scheduler hooks)."""
        start_s = time.monotonic()
        plan = self.scheduler.schedule()
        if not plan.chunks and not plan.connector_step.finished_req_ids and self.scheduler.waiting:
            if not self.scheduler.num_asked_later:
                raise RuntimeError(f"no progress possible: {len(self.scheduler.waiting)} requests wait for blocks")
            time.sleep(0.001)  # only requests the connector asked to ask again: it bounds their wait
        out = self.runner.execute(plan.chunks, plan.connector_meta, plan.connector_step.finished_req_ids)
        report = WorkerReport(out.finished_sending, out.finished_recving, out.invalid_block_ids, out.reported_steps)
        result = self.scheduler.update_from_output(plan, out.last_logits, report, out.draft_logits)
        record = StepRecord(
            step_idx=len(self.steps),
            requests=tuple(
                StepRequestRecord(c.req_id, c.start_token, len(c.token_ids), c.num_external_tokens, c.resumed)
                for c in plan.chunks
            ),
            preempted_req_ids=plan.connector_step.preempted_req_ids,
            finished_req_ids=frozenset(r.req_id for r in result.finished),
            invalid_block_ids=out.invalid_block_ids,
            discarded_req_ids=result.discarded_req_ids,
            duration_s=time.monotonic() - start_s,
        )
        self.steps.append(record)
        return record

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for hooks in self.runner.worker_hooks:
            hooks.shutdown()
