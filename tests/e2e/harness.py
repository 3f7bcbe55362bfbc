"""The oracle harness: pooled engines (producer / consumer) whose every connector talks to the
store through CheckedStore(FaultyStore(client)), local engines without hooks, and the
comparisons. One `Oracle` per test; `check_and_close()` shuts every engine down and asserts
that nothing is left in flight (no session left, no PROCESSING object, transfer threads joined).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerkv.config import LayerKVConfig
from layerkv.connector.worker import WorkerConnector
from layerkv.engine import Engine, EngineConfig, ModelConfig, RequestOutput, StepRecord
from layerkv.engine.pooled import pooled_engine
from layerkv.messages import KVRole
from layerkv.objects.keys import block_keys
from layerkv.store.base import KVStore, ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import GET_RANGES, PUT_START, FaultyStore
from tests.backends import Backend

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=5)
BLOCK_SIZE = 4


def small_engine(**changes: int) -> EngineConfig:
    """The tests' engine config (block 4, 64 blocks, budget 64) with `changes`."""
    return EngineConfig(**{"block_size": BLOCK_SIZE, "num_blocks": 64, "max_num_batched_tokens": 64, **changes})


def prompts_with_prefix(
    prefix: Sequence[int], num_tails: int, tail_tokens: int, seed: int, vocab: int = 256
) -> list[list[int]]:
    """`num_tails` prompts: `prefix` + a different random tail each."""
    rng = random.Random(seed)
    return [[*prefix, *(rng.randrange(vocab) for _ in range(tail_tokens))] for _ in range(num_tails)]


def random_tokens(num_tokens: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(num_tokens)]


# ---- engines -------------------------------------------------------------------------------


@dataclass
class PooledRun:
    """A pooled engine and its store wrappers: index 0 the scheduler's, 1 + r rank r's."""

    engine: Engine
    faults: list[FaultyStore]
    checked: list[CheckedStore]

    @property
    def workers(self) -> list[WorkerConnector]:
        return list(self.engine.runner.worker_hooks)  # type: ignore[arg-type]

    @property
    def scheduler_faults(self) -> FaultyStore:
        return self.faults[0]

    def rank_faults(self, rank: int) -> FaultyStore:
        return self.faults[1 + rank]

    def rank_checked(self, rank: int) -> CheckedStore:
        return self.checked[1 + rank]

    @property
    def namespace(self) -> str:
        return self.workers[0].namespace.name

    def keys(
        self, prompt: Sequence[int], storage_rank: int = 0, blocks: Sequence[int] | None = None
    ) -> list[ObjectKey]:
        """Object keys of `prompt`'s full blocks (or of `blocks`) on `storage_rank`."""
        from layerkv.engine import block_hashes

        hashes = block_hashes(list(prompt), self.engine.config.scheduler_block_size)
        picked = hashes if blocks is None else [hashes[i] for i in blocks]
        return block_keys(self.workers[0].namespace, picked, storage_rank)

    def range_reads(self) -> int:
        """Backend range-read calls of every rank (CheckedStore counters)."""
        return sum(s.stats()[GET_RANGES].calls for s in self.checked[1:] if GET_RANGES in s.stats())

    def put_start_keys(self, rank: int) -> list[ObjectKey]:
        return self.rank_faults(rank).keys_sent(PUT_START)


class Oracle:
    """Builds the engines of one test over `backend`."""

    def __init__(
        self, backend: Backend, model: ModelConfig = MODEL, engine_config: EngineConfig | None = None, **layerkv: Any
    ) -> None:
        self.backend = backend
        self.model = model
        base = engine_config or small_engine()
        # the tag keeps namespaces of tests apart on a shared Mooncake master
        self.engine_config = dataclasses.replace(base, model_id=f"e2e/{backend.tag}")
        plan = "groups" if layerkv.get("read_layers_per_range", 1) > 1 else "layers"  # fault tests pin per-layer reads
        self.config = LayerKVConfig.from_dict(
            {
                "load_timeout_s": 10.0,
                "save_timeout_s": 10.0,
                "store_call_timeout_s": 10.0,
                "transfer_plan": plan,
                **layerkv,
            },
            env={},
        )
        self.runs: list[PooledRun] = []
        self.locals: list[Engine] = []

    def pooled(self, role: KVRole = KVRole.BOTH, **engine_changes: Any) -> PooledRun:
        faults: list[FaultyStore] = []
        checked: list[CheckedStore] = []

        def store_factory() -> KVStore:  # called for the scheduler, then for ranks 0, 1, ...
            faulty = FaultyStore(self.backend.client(max(0, len(faults) - 1)))
            faults.append(faulty)
            checked.append(
                CheckedStore(
                    faulty,
                    max_batch_keys=self.config.max_transfer_blocks,
                    retry_interval_s=self.config.store_retry_interval_s,
                    call_timeout_s=self.config.store_call_timeout_s,
                )
            )
            return checked[-1]

        engine_config = dataclasses.replace(self.engine_config, **engine_changes)
        engine = pooled_engine(self.model, engine_config, self.config, role=role, store_factory=store_factory)
        run = PooledRun(engine, faults, checked)
        self.runs.append(run)
        return run

    def local(self, **engine_changes: Any) -> Engine:
        engine = Engine(self.model, dataclasses.replace(self.engine_config, **engine_changes))
        self.locals.append(engine)
        return engine

    def written_keys(self) -> list[ObjectKey]:
        return sorted({k for run in self.runs for f in run.faults for k in f.keys_sent(PUT_START)})

    def check_and_close(self, close_backend: bool = True) -> None:
        """Shut every engine down; assert no session left, nothing PROCESSING, threads joined.
        `close_backend` False: other oracles of the test still use the store (closed after them)."""
        problems: list[str] = []
        for i, run in enumerate(self.runs):
            for f in run.faults:
                f.clear_rules()
                f.release()
            if run.engine.has_work():
                problems.append(f"engine {i} still has work")
            for rank, worker in enumerate(run.workers):
                if not worker.is_idle(5.0):
                    problems.append(f"engine {i} rank {rank} sessions left: {worker.open_sessions()}")
            run.engine.shutdown()
            alive = [name for w in run.workers for name in w.threads_alive()]
            if alive:
                problems.append(f"engine {i}: threads alive after shutdown: {alive}")
        written = self.written_keys()
        stuck = self.backend.processing_keys(written)
        if stuck:
            problems.append(f"PROCESSING objects left: {stuck[:4]} ({len(stuck)})")
        for engine in self.locals:
            engine.shutdown()
        if close_backend:
            self.backend.close(written)
        assert not problems, "; ".join(problems)


# ---- serving and comparing -----------------------------------------------------------------


def serve(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, *, batched: bool = False
) -> list[RequestOutput]:
    """One at a time (each prompt its own generate call) or all in one call (one batch)."""
    if batched:
        return engine.generate(prompts, max_tokens)
    return [engine.generate([p], max_tokens)[0] for p in prompts]


def local_oracle(
    engine: Engine,
    producer: Sequence[Sequence[int]],
    consumer: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    producer_batched: bool = False,
    consumer_batched: bool = False,
) -> list[RequestOutput]:
    """The local run: the producer prompts with the producer's schedule first (so the prefix KV
    is computed in the same chunks, hence the same bits), then the consumer prompts."""
    serve(engine, producer, max_tokens, batched=producer_batched)
    return serve(engine, consumer, max_tokens, batched=consumer_batched)


def assert_identical(got: Sequence[RequestOutput], want: Sequence[RequestOutput]) -> None:
    """Same tokens, bit-identical logits (and MTP draft logits) per request."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, f"{g.req_id}: tokens {g.token_ids} != local {w.token_ids}"
        assert len(g.logits) == len(w.logits)
        for i, (a, b) in enumerate(zip(g.logits, w.logits)):
            assert torch.equal(a, b), (
                f"{g.req_id}: logits of token {i} differ (max abs {float((a - b).abs().max()):.3g})"
            )
        assert len(g.draft_logits) == len(w.draft_logits)
        for i, (a, b) in enumerate(zip(g.draft_logits, w.draft_logits)):
            assert torch.equal(a, b), f"{g.req_id}: draft logits of token {i} differ"


def assert_close(got: Sequence[RequestOutput], want: Sequence[RequestOutput], *, atol: float, rtol: float) -> None:
    """Same tokens, logits within tolerance (for runs whose chunk boundaries differ)."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, f"{g.req_id}: tokens {g.token_ids} != local {w.token_ids}"
        for i, (a, b) in enumerate(zip(g.logits, w.logits)):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, i=i, r=g.req_id: f"{r} token {i}: {m}")


def chunks_of(engine: Engine, req_id: str, steps: Sequence[StepRecord] | None = None) -> list[tuple[int, int, int]]:
    """A request's schedule: (num_computed_tokens, num_scheduled_tokens, num_external_tokens) per
    step in which its output was kept (a discarded step is recomputed, its chunk does not count)."""
    return [
        (r.num_computed_tokens, r.num_scheduled_tokens, r.num_external_tokens)
        for s in (engine.steps if steps is None else steps)
        for r in s.requests
        if r.req_id == req_id and r.req_id not in s.discarded_req_ids
    ]


def computed_chunks(engine: Engine, req_id: str) -> list[tuple[int, int]]:
    """(first token, num tokens) computed per kept step: what decides a request's float bits."""
    return [(start, n) for start, n, _ in chunks_of(engine, req_id)]


# ---- the oracle scenario shared by the oracle tests -----------------------------------------

PREFIX = random_tokens(22, seed=1)  # 5 full blocks + 2 tokens
HIT_TOKENS = 20  # the full blocks the producer and consumer prompts share
MAX_TOKENS = 3


def two_docs(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two documents with their own 22-token prefix: (producer prompts, consumer prompts)."""
    prefixes = [random_tokens(22, seed=seed), random_tokens(22, seed=seed + 1)]
    producer = [prompts_with_prefix(p, 1, 6, seed=seed + 2 + i)[0] for i, p in enumerate(prefixes)]
    consumer = [prompts_with_prefix(p, 1, 9, seed=seed + 4 + i)[0] for i, p in enumerate(prefixes)]
    return producer, consumer


def produce_and_consume(
    oracle: Oracle,
    producer_prompts: Sequence[Sequence[int]],
    consumer_prompts: Sequence[Sequence[int]],
    *,
    producer_batched: bool = False,
    consumer_batched: bool = False,
) -> tuple[PooledRun, PooledRun, list[RequestOutput]]:
    """Producer run, consumer run, local run; asserts the consumer equals the local run."""
    producer = oracle.pooled()
    serve(producer.engine, producer_prompts, MAX_TOKENS, batched=producer_batched)
    consumer = oracle.pooled()
    got = serve(consumer.engine, consumer_prompts, MAX_TOKENS, batched=consumer_batched)
    local = oracle.local()
    want = local_oracle(
        local,
        producer_prompts,
        consumer_prompts,
        MAX_TOKENS,
        producer_batched=producer_batched,
        consumer_batched=consumer_batched,
    )
    assert_identical(got, want)
    # the local run hit its prefix cache exactly where the consumer hit the pool (or its own cache)
    assert [w.num_local_cached_tokens for w in want] == [g.num_local_cached_tokens + g.num_external_tokens for g in got]
    return producer, consumer, got


def assert_loaded(consumer: PooledRun, got: Sequence[RequestOutput], hit_tokens: int) -> None:
    """The consumer really loaded `hit_tokens` per request, on every rank, through range reads."""
    assert [o.num_external_tokens for o in got] == [hit_tokens] * len(got)
    assert all(o.num_local_cached_tokens == 0 for o in got)
    for rank, worker in enumerate(consumer.workers):
        stats = worker.stats()
        assert stats.load_range_calls > 0 and stats.loaded_bytes > 0, f"rank {rank}: {stats}"
        assert stats.load_failed_blocks == 0 and stats.transfer_errors == 0, f"rank {rank}: {stats}"
        assert consumer.rank_checked(rank).stats()[GET_RANGES].calls >= stats.load_range_calls
    assert consumer.range_reads() > 0


MLA_MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    seed=8,
    mla_latent_dim=24,
    index_dim=8,
    num_mtp_layers=1,
)


def oracles(backend: Backend) -> Iterator[Callable[..., Oracle]]:
    """The body of a `make_oracle` fixture: yields `make(**kwargs) -> Oracle` over `backend`;
    at teardown shuts every oracle down, asserts nothing was left in flight, closes the backend."""
    made: list[Oracle] = []

    def make(**kwargs: Any) -> Oracle:
        oracle = Oracle(backend, **kwargs)
        made.append(oracle)
        return oracle

    yield make
    errors = []
    for oracle in made:  # one store may serve several oracles: it closes after the last
        try:
            oracle.check_and_close(close_backend=False)
        except AssertionError as exc:
            errors.append(str(exc))
    backend.close(sorted({k for oracle in made for k in oracle.written_keys()}))
    assert not errors, "; ".join(errors)
