"""`layerkv demo`: the main job. A producer engine serves prompts with shared prefixes and
fills the pool layer by layer; a fresh consumer engine serves follow-up prompts, loading the
prefixes layer by layer; a local engine without the pool serves the same prompts (the oracle,
whose TTFT with the prefix in its own cache is the pool's ceiling) and a cold one recomputes
everything (the TTFT baseline). Single-threaded driver.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from layerkv.config import LayerKVConfig
from layerkv.engine import Engine, EngineConfig, ModelConfig, RequestOutput
from layerkv.engine.pooled import pooled_engine
from layerkv.store.checked import CheckedStore
from layerkv.store.factory import open_checked_store

DEMO_MODEL = ModelConfig(
    num_layers=8,
    hidden_size=256,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=768,
    vocab_size=2048,
    seed=7,
)


@dataclass(frozen=True, slots=True)
class DemoRow:
    request: str
    prompt_tokens: int
    loaded_tokens: int
    computed_tokens: int
    ttft_pool_ms: float
    ttft_recompute_ms: float
    loaded_bytes: int
    range_calls: int
    ttft_local_ms: float  # the same prompt with its prefix in the engine's own cache: the pool's ceiling
    load_wait_ms: float  # of ttft_pool_ms, the compute thread's wait for layers still in transit


@dataclass(frozen=True, slots=True)
class DemoResult:
    backend: str
    tp_size: int
    rows: tuple[DemoRow, ...]
    producer_saved_bytes: int
    identical: bool
    mismatch: str
    checksum_failures: int = 0  # layers whose bytes failed verification (recomputed, objects removed)


def make_prompts(
    num_docs: int, prefix_tokens: int, question_tokens: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(producer prompts, consumer prompts): doc i's prefix + two different questions."""
    rng = random.Random(seed)
    producer, consumer = [], []
    for _ in range(num_docs):
        prefix = [rng.randrange(vocab) for _ in range(prefix_tokens)]
        producer.append(prefix + [rng.randrange(vocab) for _ in range(question_tokens)])
        consumer.append(prefix + [rng.randrange(vocab) for _ in range(question_tokens + 7)])
    return producer, consumer


def run_demo(
    config: LayerKVConfig,
    *,
    store_factory: Callable[[], CheckedStore] | None = None,
    tp_size: int = 1,
    num_docs: int = 4,
    prefix_tokens: int = 384,
    question_tokens: int = 24,
    max_tokens: int = 8,
    model: ModelConfig = DEMO_MODEL,
    progress: bool = True,
    device: str = "cpu",
) -> DemoResult:
    make_store = store_factory or (lambda: open_checked_store(config))
    engine_config = EngineConfig(
        block_size=16,
        num_blocks=256,
        max_num_batched_tokens=512,
        tp_size=tp_size,
        model_id="layerkv/demo-llama",
        device=device,
    )
    producer_prompts, consumer_prompts = make_prompts(
        num_docs, prefix_tokens, question_tokens, model.vocab_size, seed=1
    )

    # one store client per connector: Mooncake get sessions belong to a client, so TP ranks
    # reading the same key must not share one (as separate worker processes would not)
    producer_stores: list[CheckedStore] = []
    producer = pooled_engine(model, engine_config, config, store_factory=_collecting(make_store, producer_stores))
    bar = tqdm(total=4 * num_docs, desc="layerkv demo", disable=not progress, leave=False)  # after the store opened
    _serve(producer, producer_prompts, "producer fills the pool", bar, max_tokens)
    saved_bytes = _io(producer_stores, ("batch_put_from_multi_buffer_ranges",))[0]
    producer.shutdown()

    consumer_stores: list[CheckedStore] = []
    consumer = pooled_engine(model, engine_config, config, store_factory=_collecting(make_store, consumer_stores))
    pooled = _load_from_pool(consumer, consumer_prompts, consumer_stores, bar, max_tokens)
    checksum_failures = _checksum_failures(consumer)
    consumer.shutdown()
    for store in producer_stores + consumer_stores:
        store.close()

    oracle = _local_oracle(model, engine_config, producer_prompts, consumer_prompts, max_tokens)
    cold = _serve(Engine(model, engine_config), consumer_prompts, "recompute baseline", bar, max_tokens)
    bar.update(num_docs)
    bar.close()

    identical, mismatch = _compare([p.output for p in pooled], oracle)
    rows = _rows(pooled, cold, oracle)
    return DemoResult(config.backend, tp_size, rows, saved_bytes, identical, mismatch, checksum_failures)


def _rows(pooled: list[_PooledOutput], cold: list[RequestOutput], oracle: list[RequestOutput]) -> tuple[DemoRow, ...]:
    """One table row per consumer request: what the pool loaded and its TTFT beside recompute's and local's."""
    return tuple(
        DemoRow(
            p.output.req_id,
            len(p.output.prompt_token_ids),
            p.output.num_external_tokens,
            len(p.output.prompt_token_ids) - p.output.num_external_tokens,
            p.output.ttft_s * 1e3,
            c.ttft_s * 1e3,
            p.loaded_bytes,
            p.range_calls,
            ttft_local_ms=local_out.ttft_s * 1e3,
            load_wait_ms=p.load_wait_s * 1e3,
        )
        for p, c, local_out in zip(pooled, cold, oracle)
    )


def _serve(engine: Engine, prompts: list[list[int]], stage: str, bar: tqdm, max_tokens: int) -> list[RequestOutput]:
    """`prompts` one at a time (clean TTFT and per-request store counters), the heap frozen."""
    bar.set_postfix_str(stage)
    outputs = []
    with _static_heap():
        for prompt in prompts:
            outputs.extend(engine.generate([prompt], max_tokens))
            bar.update()
    return outputs


@dataclass(frozen=True, slots=True)
class _PooledOutput:
    output: RequestOutput
    loaded_bytes: int  # what this request read from the pool
    range_calls: int  # the backend data calls of those reads
    load_wait_s: float  # the compute thread's wait for layers in transit


def _load_from_pool(
    consumer: Engine, prompts: list[list[int]], stores: list[CheckedStore], bar: tqdm, max_tokens: int
) -> list[_PooledOutput]:
    """The consumer serves each prompt, loading its prefix from the pool; with what each moved."""
    pooled: list[_PooledOutput] = []
    for prompt in prompts:
        before, waited = _io(stores), _load_wait_s(consumer)
        outputs = _serve(consumer, [prompt], "consumer loads from the pool", bar, max_tokens)
        after = _io(stores)
        wait_s = _load_wait_s(consumer) - waited
        pooled.extend(_PooledOutput(o, after[0] - before[0], after[1] - before[1], wait_s) for o in outputs)
    return pooled


def _local_oracle(
    model: ModelConfig,
    engine_config: EngineConfig,
    producer_prompts: list[list[int]],
    consumer_prompts: list[list[int]],
    max_tokens: int,
) -> list[RequestOutput]:
    """A local engine without the pool: the same prefixes computed locally first (the producer's
    schedule, so prefix KV bytes are the same), then the consumer's prompts."""
    local = Engine(model, engine_config)
    for prompt in producer_prompts:
        local.generate([prompt], max_tokens)
    return [local.generate([p], max_tokens)[0] for p in consumer_prompts]


@contextlib.contextmanager
def _static_heap() -> Iterator[None]:
    """What vLLM's engine core does once it started (gc.collect(); gc.freeze()): the objects
    that exist now are left out of garbage collection, so a full collection of the model's and
    the engines' start-up heap (~80 ms here) does not land inside a timed request. Undone after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _collecting(make_store: Callable[[], CheckedStore], into: list[CheckedStore]) -> Callable[[], CheckedStore]:
    def factory() -> CheckedStore:
        into.append(make_store())
        return into[-1]

    return factory


_LOAD_CALLS = ("batch_get_into_multi_buffer_ranges", "batch_get_into")  # range reads, whole-object reads


def _io(stores: list[CheckedStore], calls: tuple[str, ...] = _LOAD_CALLS) -> tuple[int, int]:
    """(bytes moved, backend data calls) of `calls` so far over `stores`, from the CheckedStore counters."""
    nbytes = num_calls = 0
    for store in stores:
        for call in calls:
            stats = store.stats().get(call)
            if stats:
                nbytes, num_calls = nbytes + stats.nbytes, num_calls + stats.calls
    return nbytes, num_calls


def _load_wait_s(engine: Engine) -> float:
    """Seconds the engine's compute thread has waited for layers in transit, over its ranks (one
    thread runs every rank here, so the ranks' waits add up)."""
    return sum(w.stats().load_wait_s for w in engine.runner.worker_hooks)  # type: ignore[attr-defined]


def _checksum_failures(engine: Engine) -> int:
    """Layers whose bytes failed verification in the engine's loads, over its ranks (recomputed)."""
    return sum(w.stats().checksum_failures for w in engine.runner.worker_hooks)  # type: ignore[attr-defined]


def _compare(pooled: list[RequestOutput], oracle: list[RequestOutput]) -> tuple[bool, str]:
    for got, want in zip(pooled, oracle):
        if got.token_ids != want.token_ids:
            return False, f"{got.req_id}: tokens {got.token_ids} != local {want.token_ids}"
        for i, (a, b) in enumerate(zip(got.logits, want.logits)):
            if not torch.equal(a, b):
                return False, f"{got.req_id}: logits of token {i} differ (max abs {float((a - b).abs().max()):.3g})"
    return True, ""


def format_result(result: DemoResult) -> str:
    """The table; `TTFT local ms` is the pool's ceiling (the prefix already in the engine's own
    cache), `waited ms` the part of `TTFT pool ms` the compute thread spent waiting for layers."""
    head = (
        f"{'request':<8} {'prompt':>6} {'loaded':>6} {'computed':>8} {'TTFT pool ms':>12} "
        f"{'TTFT recompute ms':>17} {'speed-up':>8} {'TTFT local ms':>13} {'waited ms':>9} "
        f"{'bytes loaded':>12} {'range calls':>11}"
    )
    lines = [
        f"store: {result.backend}, tp_size={result.tp_size}, producer saved {result.producer_saved_bytes} bytes",
        head,
    ]
    for r in result.rows:
        lines.append(
            f"{r.request:<8} {r.prompt_tokens:>6} {r.loaded_tokens:>6} {r.computed_tokens:>8} {r.ttft_pool_ms:>12.1f} "
            f"{r.ttft_recompute_ms:>17.1f} {r.ttft_recompute_ms / max(r.ttft_pool_ms, 1e-9):>7.1f}x "
            f"{r.ttft_local_ms:>13.1f} {r.load_wait_ms:>9.1f} {r.loaded_bytes:>12} {r.range_calls:>11}"
        )
    lines.append("outputs identical to local compute: " + ("yes" if result.identical else f"NO ({result.mismatch})"))
    return "\n".join(lines)


def result_json(result: DemoResult) -> str:
    return json.dumps(asdict(result), indent=2)
