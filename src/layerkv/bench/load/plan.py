"""What `layerkv bench load` runs (pure: no processes): the model, the workload vLLM's benchmark
client sends (prefix_repetition, Poisson arrivals), the scenarios (local KV cache and pool sized
against the working set, one or two servers) and the contenders. Driver thread only.

Sizes, in KV tokens (a token's K and V over every layer: `LoadModel.kv_bytes_per_token`):

    working set   num_prefixes x prefix_tokens          (the shared prefixes)
    local cache   working set x local_fraction          (per server; at least one request)
    pool          capacity / two-servers: every prefix and up to 256 requests' own blocks, 1.25x
                  eviction: working set x pool_fraction (Mooncake evicts; LMCache its LRU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from layerkv.bench.vllm.model import kv_bytes_per_token

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MiB = 1 << 20
MAX_OWN_REQUESTS = 256  # requests whose own (suffix + output) blocks the capacity pool has room for
NONE, LAYERKV, MOONCAKE, LMCACHE = "none", "layerkv", "mooncake", "lmcache"
# what each cost is made of: layerkv that only loads (kv_consumer: the hooks, no save), layerkv
# saving prompts only (save_decode_blocks false, as MooncakeStoreConnector by default), and
# MooncakeStoreConnector saving the blocks decode fills too (save_decode_cache), as layerkv does
LAYERKV_CONSUMER, LAYERKV_PROMPTS, MOONCAKE_SAVE_DECODE = "layerkv-consumer", "layerkv-prompts", "mooncake-save-decode"
LAYERKV_KINDS = (LAYERKV, LAYERKV_CONSUMER, LAYERKV_PROMPTS)
CONTENDERS = (NONE, LAYERKV, LAYERKV_CONSUMER, LAYERKV_PROMPTS, MOONCAKE, MOONCAKE_SAVE_DECODE, LMCACHE)
CONTENDER_TITLES = {
    NONE: "no connector",
    LAYERKV: "layerkv (Mooncake)",
    LAYERKV_CONSUMER: "layerkv, kv_consumer (loads only)",
    LAYERKV_PROMPTS: "layerkv, save_decode_blocks false (saves prompts only)",
    MOONCAKE: "vLLM MooncakeStoreConnector",
    MOONCAKE_SAVE_DECODE: "MooncakeStoreConnector, save_decode_cache",
    LMCACHE: "LMCache 0.5.6 (multiprocess)",
}
CAPACITY, EVICTION, TWO_SERVERS, DECODE = "capacity", "eviction", "two-servers", "decode"
SCENARIOS = (CAPACITY, EVICTION, TWO_SERVERS, DECODE)


@dataclass(frozen=True, slots=True)
class LoadModel:
    """A random-weight Llama (layerkv.bench.vllm.model.save_random_llama) with the 3-letter word tokenizer."""

    num_layers: int
    hidden_size: int
    dtype: str = "float32"
    lm_head_scale: float = 10.0  # greedy tokens stable across schedules: outputs are compared

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.hidden_size, self.dtype)


@dataclass(frozen=True, slots=True)
class Workload:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes, each followed by
    num_requests / num_prefixes random suffixes, shuffled, sent at `request_rate` (Poisson)."""

    num_prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    num_requests: int
    request_rate: float  # requests per second
    seed: int = 0
    max_concurrency: int | None = None  # requests in flight at most (vLLM client's --max-concurrency)

    @property
    def working_set_tokens(self) -> int:
        return self.num_prefixes * self.prefix_tokens

    @property
    def request_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens + self.output_tokens

    @property
    def max_model_len(self) -> int:
        return _round_up(self.request_tokens, BLOCK_SIZE)

    def for_duration(self, seconds: float) -> Workload:
        """As many requests as `request_rate` sends in `seconds` (a soak)."""
        count = max(self.num_prefixes, int(self.request_rate * seconds))
        return replace(self, num_requests=count - count % self.num_prefixes)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    num_servers: int = 1
    local_fraction: float = 0.25  # of the working set, per server
    pool_fraction: float | None = None  # of the working set; None: room for everything


SCENARIO_OF = {
    CAPACITY: Scenario(CAPACITY),
    EVICTION: Scenario(EVICTION, pool_fraction=0.5),
    TWO_SERVERS: Scenario(TWO_SERVERS, num_servers=2),
    DECODE: Scenario(DECODE, local_fraction=1.0),
}
# `decode` runs alone, with a workload of its own: every prompt distinct (no hit), long answers,
# a fixed number of requests in flight: what a connector costs the steps that move nothing
DECODE_WORKLOAD = Workload(48, 256, 32, 256, 48, math.inf, max_concurrency=16)
DECODE_WORKLOAD_TINY = Workload(4, 64, 32, 16, 4, math.inf, max_concurrency=4)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    model: LoadModel
    workload: Workload
    scenarios: tuple[str, ...]
    contenders: tuple[str, ...]
    soak_s: float = 0.0  # > 0: the capacity scenario only, held this long
    idle_s: float = 20.0  # after the load: gauges must reach 0 within this
    sample_every_s: float = 2.0  # RSS / gauge sampling period

    @classmethod
    def build(
        cls,
        *,
        tiny: bool,
        scenarios: tuple[str, ...] = (),
        contenders: tuple[str, ...] = (),
        soak_s: float = 0.0,
        request_rate: float | None = None,
        num_requests: int | None = None,
    ) -> LoadPlan:
        """The full plan, or `tiny` (the smoke of `make test`: a small model, 24 requests)."""
        for name, given, known in (("scenario", scenarios, SCENARIOS), ("contender", contenders, CONTENDERS)):
            unknown = sorted(set(given) - set(known))
            if unknown:
                raise ValueError(f"unknown load {name}(s) {unknown}; known: {', '.join(known)}")
        if DECODE in scenarios and len(set(scenarios)) > 1:
            raise ValueError("the load scenario decode runs alone (its workload is its own): --scenario decode")
        if tiny:
            model, workload = LoadModel(2, 256), Workload(8, 256, 32, 8, 24, 6.0)
        else:
            model, workload = LoadModel(4, 512), Workload(16, 1024, 64, 32, 128, 2.0)
        if DECODE in scenarios:
            workload = DECODE_WORKLOAD_TINY if tiny else DECODE_WORKLOAD
        if request_rate is not None:
            workload = replace(workload, request_rate=request_rate)
        if num_requests is not None:
            workload = replace(workload, num_requests=num_requests)
        if soak_s > 0:
            workload, scenarios = workload.for_duration(soak_s), (CAPACITY,)
        chosen = tuple(c for c in CONTENDERS if c in contenders) if contenders else (NONE, LAYERKV, MOONCAKE)
        return cls(
            model,
            workload,
            tuple(s for s in SCENARIOS if s in scenarios) if scenarios else SCENARIOS[:3],
            chosen,
            soak_s,
            idle_s=10.0 if tiny else 20.0,
            sample_every_s=1.0 if tiny else 2.0,
        )

    def local_blocks(self, scenario: Scenario) -> int:
        """Each server's KV cache in blocks (vLLM's --num-gpu-blocks-override): the scenario's share
        of the working set, at least one max_model_len request and 2 blocks (vLLM refuses less)."""
        share = math.ceil(self.workload.working_set_tokens * scenario.local_fraction / BLOCK_SIZE)
        return max(share, self.workload.max_model_len // BLOCK_SIZE + 2)

    def pool_bytes(self, scenario: Scenario) -> int:
        """The pool's capacity (Mooncake segment, LMCache's CPU memory)."""
        w, per_token = self.workload, self.model.kv_bytes_per_token
        if scenario.pool_fraction is not None:
            return max(8 * MiB, int(w.working_set_tokens * scenario.pool_fraction * per_token))
        # every prefix and the own blocks of up to MAX_OWN_REQUESTS requests: a soak's thousands of
        # requests then make the pool evict old requests' own blocks, as a long-running one does
        own = min(w.num_requests, MAX_OWN_REQUESTS) * (w.suffix_tokens + w.output_tokens)
        return _round_up(int((w.working_set_tokens + own) * per_token * 1.25) + 64 * MiB, MiB)

    def client_args(self, base_url: str, model_path: str, served_name: str) -> list[str]:
        """vLLM's benchmark client (vllm.benchmarks.serve) arguments: greedy, EOS ignored, every
        latency percentile the report shows, per-request results kept (--save-detailed: TTFTs,
        texts, errors), no ready-check request (it would warm one prefix)."""
        w = self.workload
        return [
            "--base-url",
            base_url,
            "--model",
            served_name,
            "--tokenizer",
            model_path,
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(w.prefix_tokens),
            "--prefix-repetition-suffix-len",
            str(w.suffix_tokens),
            "--prefix-repetition-num-prefixes",
            str(w.num_prefixes),
            "--prefix-repetition-output-len",
            str(w.output_tokens),
            "--num-prompts",
            str(w.num_requests),
            "--request-rate",
            str(w.request_rate),
            "--seed",
            str(w.seed),
            "--ignore-eos",
            "--temperature",
            "0",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
            "--ready-check-timeout-sec",
            "0",
            "--disable-tqdm",
            "--save-detailed",
            *(["--max-concurrency", str(w.max_concurrency)] if w.max_concurrency else []),
        ]

    def client_timeout_s(self) -> float:
        """A bound for one client run: the arrivals, then generous service time per request."""
        w = self.workload
        arrivals = w.num_requests / w.request_rate * 2 if math.isfinite(w.request_rate) else 0.0
        return arrivals + 60 + w.num_requests * 5


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
