"""What the cluster fault tests share: their prompts, an engine job, the bit-identity check
against local compute, and the gate dance (cut a host's link where the engine waits, go on,
heal it where it waits again, go on)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from layerkv.engine import Engine
from layerkv.engine.request import RequestOutput
from tests.cluster.pool import Pool, Proc
from tests.e2e.harness import MODEL, local_oracle, prompts_with_prefix, random_tokens, serve, small_engine

MAX_TOKENS = 3
PREFIX_TOKENS, HIT_TOKENS = 22, 20  # 5 full blocks of 4 are shared
# bounded waits: a cut link costs these, never a hang
FAST_FAILURE = {"load_timeout_s": 8.0, "save_timeout_s": 8.0, "store_call_timeout_s": 8.0}
# a master partition shorter than Mooncake's client_ttl (10 s) keeps every client's segments
MASTER_FAILURE = {"load_timeout_s": 3.0, "save_timeout_s": 3.0, "store_call_timeout_s": 3.0}


@dataclasses.dataclass
class Prompts:
    producer: list[list[int]]
    consumer: list[list[int]]
    probes: list[list[int]]  # prefixes the consumer never computed: served to see hits return
    probe_writes: list[list[int]]  # the same prefixes as a producer would serve them


def make_prompts(seed: int, num: int = 2, num_probes: int = 0) -> Prompts:
    prefixes = [random_tokens(PREFIX_TOKENS, seed=seed + 10 * i) for i in range(num + num_probes)]
    producer = [prompts_with_prefix(p, 1, 6, seed=seed + 10 * i + 1)[0] for i, p in enumerate(prefixes)]
    consumer = [prompts_with_prefix(p, 1, 9, seed=seed + 10 * i + 2)[0] for i, p in enumerate(prefixes)]
    return Prompts(producer[:num], consumer[:num], consumer[num:], producer[num:])


def job(tag: str, prompts: Sequence[Sequence[int]], **extra: Any) -> dict[str, Any]:
    engine = dataclasses.replace(small_engine(), model_id=f"cluster/{tag}")
    return {
        "model": dataclasses.asdict(MODEL),
        "engine": dataclasses.asdict(engine),
        "prompts": [list(p) for p in prompts],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def _identical(a: RequestOutput, b: RequestOutput) -> bool:
    return (
        a.token_ids == b.token_ids
        and len(a.logits) == len(b.logits)
        and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    )


def assert_local(tag: str, got: Sequence[RequestOutput], prompts: Prompts, prefer: str = "loaded") -> list[str]:
    """Each output equals a local run: with the producer's prefix KV, or fresh (recomputed from
    the first block). Returns which it equals, per request, `prefer` ("loaded" or "recomputed")
    first: the two may be the same bits (how many rows share a chunk may or may not change a
    row's rounding), so the hit tokens and stats tell which path ran."""
    config = dataclasses.replace(small_engine(), model_id=f"cluster/{tag}")
    loaded = local_oracle(Engine(MODEL, config), prompts.producer, prompts.consumer, MAX_TOKENS)
    fresh = serve(Engine(MODEL, config), prompts.consumer, MAX_TOKENS)
    kinds = []
    for g, want, alone in zip(got, loaded, fresh, strict=True):
        matches = [kind for kind, run in (("loaded", want), ("recomputed", alone)) if _identical(g, run)]
        if matches:
            kinds.append(prefer if prefer in matches else matches[0])
        else:
            raise AssertionError(
                f"{g.req_id}: equals neither the local run with the pool's prefix nor a fresh local run"
            )
    return kinds


def cut_at_gate(pool: Pool, proc: Proc, host: str, hold_s: float = 0.0) -> dict[str, Any]:
    """`proc` waits at its gate: cut `host`, let it go on; at its second gate (its prompts
    served) keep the cut `hold_s` longer, heal, let it probe; its report."""
    try:
        proc.line("@@gate", 120.0)
        pool.cluster.cut(host)
        proc.send()
        proc.line("@@gate", 120.0)
        time.sleep(hold_s)  # bounded: the test's own constant
        pool.cluster.heal(host)
        proc.send()
        return pool.report(proc)
    finally:
        pool.cluster.heal(host)
