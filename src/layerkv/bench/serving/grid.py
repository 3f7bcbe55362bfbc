"""What suite `serving` measures: the model, the TTFT grid, the contenders and engines it needs,
the pool and cache sizes, and the prompts (pure: no processes). Driver thread only."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from layerkv.bench.common import BenchOptions
from layerkv.bench.serving import report
from layerkv.bench.serving.report import LAYERKV_DIRECT
from layerkv.bench.vllm.model import kv_bytes_per_token, native_dtype, tokens

NAME = "serving"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
GiB = 1 << 30
ENGINES = (
    "plain",
    "layerkv-producer",
    "layerkv",
    "layerkv-direct",
    "mooncake-producer",
    "mooncake",
    "layerkv-keyed-producer",
    "layerkv-keyed",
    "layerkv-encrypted-producer",
    "layerkv-encrypted",
)
# the engines a contender needs (a pool contender: its producer, which fills the pool, and its consumer)
ENGINES_OF = {
    report.RECOMPUTE: ("plain",),
    report.CEILING: ("plain",),
    report.LAYERKV: ("layerkv-producer", "layerkv"),
    LAYERKV_DIRECT: ("layerkv-producer", "layerkv-direct"),
    report.MOONCAKE: ("mooncake-producer", "mooncake"),
    report.LAYERKV_KEYED: ("layerkv-keyed-producer", "layerkv-keyed"),
    report.LAYERKV_ENCRYPTED: ("layerkv-encrypted-producer", "layerkv-encrypted"),
}
LOAD_PREFIXES, LOAD_PREFIX_TOKENS, LOAD_SUFFIX_TOKENS, LOAD_MAX_TOKENS = 4, 2048, 128, 16
LOAD_MISS_EVERY = 5  # every 5th request of the load batch has a prefix of its own (80 % pool hits)


@dataclass(frozen=True, slots=True)
class Grid:
    """The model and the TTFT grid. `--quick` (a first look in under 5 minutes): 2 x 2 cells, one
    repeat, no `register_kv_cache` engine, no load batch; full: 2 x 3 cells (2,048-token
    suffixes), 3 repeats, every contender, two 12-request load batches (the `register_kv_cache`
    engine is stopped before them: seven processes' memory was past this machine's edge)."""

    prefixes: tuple[int, ...]
    suffixes: tuple[int, ...]
    repeats: int
    num_layers: int = 8
    hidden_size: int = 1024
    dtype: str = "float32"
    load_requests: int = 16  # throughput under load: concurrent requests over LOAD_PREFIXES prefixes
    load_repeats: int = 2
    contenders: tuple[str, ...] = report.CONTENDERS

    @classmethod
    def for_options(cls, options: BenchOptions) -> Grid:
        """The mode's grid (`--tenant-keys`, `--quick` or full), its prefixes, suffixes and repeats
        replaced by the options' where given (`--prefix`, `--suffix`, `--repeats`)."""
        grid = cls._for_mode(options)
        uneven = [n for n in options.serving_prefixes if n % BLOCK_SIZE]
        if uneven:
            raise ValueError(
                f"--prefix {uneven[0]}: a prefix must be whole {BLOCK_SIZE}-token blocks (only whole blocks are cached)"
            )
        return replace(
            grid,
            prefixes=options.serving_prefixes or grid.prefixes,
            suffixes=options.serving_suffixes or grid.suffixes,
            repeats=options.serving_repeats or grid.repeats,
        )

    @classmethod
    def _for_mode(cls, options: BenchOptions) -> Grid:
        if options.tenant_keys:  # what a tenant key and encryption cost, side by side with no key
            return cls(
                (512, 2048),
                (32, 512),
                1 if options.quick else 3,
                dtype=native_dtype(),
                load_requests=8,
                load_repeats=0,
                contenders=report.KEY_CONTENDERS,
            )
        if options.quick:
            return cls(
                (512, 2048),
                (32, 512),
                1,
                dtype=native_dtype(),
                load_requests=8,
                load_repeats=0,
                contenders=tuple(c for c in report.CONTENDERS if c != LAYERKV_DIRECT),
            )
        # 8,192-token prefixes are left out: six engines hold ~15 GB of this machine's 23 GB and
        # that row's pool would need ~5 GB more (Grid.pool_bytes)
        return cls((512, 2048), (32, 512, 2048), 3, dtype=native_dtype(), load_requests=12)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines this grid's contenders need (ENGINES_OF), in ENGINES' order."""
        return tuple(e for e in ENGINES if any(e in ENGINES_OF[c] for c in self.contenders))

    @property
    def num_producers(self) -> int:
        return sum(e.endswith("producer") for e in self.engines)

    @property
    def max_model_len(self) -> int:
        return max(self.prefixes) + max(self.suffixes) + BLOCK_SIZE

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.hidden_size, self.dtype)

    def engine_cache_gib(self) -> int:
        """VLLM_CPU_KVCACHE_SPACE: the longest prompt (its prefix blocks are the cached ones) or
        the load batch (shared prefixes once, own prefixes), with a tenth to spare (a batch
        that does not fit waits in vLLM's queue). Every GiB is allocated
        and zeroed in each of the six engines."""
        own_prefixes = self.load_requests // LOAD_MISS_EVERY
        load_tokens = (LOAD_PREFIXES + own_prefixes) * LOAD_PREFIX_TOKENS + self.load_requests * (
            LOAD_SUFFIX_TOKENS + LOAD_MAX_TOKENS
        )
        return max(1, math.ceil(max(self.max_model_len, load_tokens) * self.kv_bytes_per_token * 1.1 / GiB))

    def pool_bytes(self) -> int:
        """Every producer's objects: every prefix once, every reference run's suffix blocks,
        the load prefixes, the warm-up (one step per prefix size); nothing has to be evicted."""
        num_tokens = self.repeats * (sum(self.prefixes) + len(self.prefixes) * sum(self.suffixes))
        num_tokens += self.load_repeats * LOAD_PREFIXES * LOAD_PREFIX_TOKENS
        num_tokens += sum(self.prefixes) + len(self.prefixes) * min(self.suffixes)  # the warm-up
        return int(self.num_producers * num_tokens * self.kv_bytes_per_token * 1.15) + GiB // 2


def prefix_ids(prefix_tokens: int, repeat: int) -> list[int]:
    return tokens(1000 * prefix_tokens + repeat + 1, prefix_tokens)


def suffix_ids(suffix_tokens: int, repeat: int) -> list[int]:
    """Distinct per length too: a 32-token suffix must not be the first block of the 512 one."""
    return tokens(500_000 + 1000 * suffix_tokens + repeat, suffix_tokens)


def load_prompts(num_requests: int, repeat: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the shared prefixes, one prompt per request + its own suffix): request i's prefix is
    shared prefix i % LOAD_PREFIXES, except every LOAD_MISS_EVERY-th request's, which is its
    own (never saved: a pool miss, recomputed in every contender)."""
    prefixes = [tokens(900_000 + 100 * repeat + k, LOAD_PREFIX_TOKENS) for k in range(LOAD_PREFIXES)]

    def prefix(i: int) -> list[int]:
        if i % LOAD_MISS_EVERY == LOAD_MISS_EVERY - 1:
            return tokens(700_000 + 1000 * repeat + i, LOAD_PREFIX_TOKENS)
        return prefixes[i % LOAD_PREFIXES]

    return prefixes, [prefix(i) + tokens(800_000 + 1000 * repeat + i, LOAD_SUFFIX_TOKENS) for i in range(num_requests)]
