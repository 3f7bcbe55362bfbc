"""The engines of the chaos tier, the same in the test process and in agent processes: the
reference engine pooled over CheckedStore(FaultyStore(Gate(a Mooncake client))), requests
served one at a time and timed, outputs as plain JSON (logits as base64 float32 bytes).

Bits do not depend on the schedule here: the token budget equals the block size, so every
prompt block is computed as one chunk of its own whether it is computed by a producer, a
consumer after a failed load, or the local oracle. A prompt is never block-aligned (a full
hit would compute only its last token). So every pooled output must equal local compute bit
for bit, whatever hits, misses and recomputes the faults caused.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

from layerkv.config import LayerKVConfig
from layerkv.engine import Engine, EngineConfig, ModelConfig
from layerkv.engine.pooled import pooled_engine
from layerkv.store.checked import CheckedStore
from layerkv.store.faults import GET_START, PUT_START, FaultyStore
from tests.chaos.gate import Announce, Gate

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=5)
ENGINE = EngineConfig(block_size=8, num_blocks=96, max_num_batched_tokens=8, max_num_seqs=4)  # objects of 8.2 KiB

# The connector config of every chaos engine. Bounds: a layer not read within load_timeout_s is
# recomputed, a save not written within save_timeout_s revoked, a call to the master answers
# within store_call_timeout_s (Mooncake's own answer to a hung master takes 30 s).
LAYERKV: dict[str, Any] = {
    "backend": "mooncake",
    "load_timeout_s": 2.0,
    "save_timeout_s": 2.0,
    "store_call_timeout_s": 2.0,
    "store_retry_interval_s": 2.0,
}
# A fault may cost a request one load timeout (its layers are recomputed), one save timeout
# (its saves are revoked) and two bounded calls to the master (the scheduler's lookup, a
# commit). Local compute of a chaos request takes < 0.5 s on an idle core; the slack is room
# for 2 cores shared with other jobs (steps ran 10x slower at a load average of 6).
COMPUTE_SLACK_S = 6.0
REQUEST_BOUND_S = (
    LAYERKV["load_timeout_s"] + LAYERKV["save_timeout_s"] + 2 * LAYERKV["store_call_timeout_s"] + COMPUTE_SLACK_S
)


def make_config(layerkv: dict[str, Any]) -> LayerKVConfig:
    """The config, without keys an older layerkv does not know (the tier also runs on old code)."""
    known = {f.name for f in dataclasses.fields(LayerKVConfig)}
    return LayerKVConfig.from_dict({k: v for k, v in layerkv.items() if k in known}, env={})


def checked_store(backend: Any, config: LayerKVConfig) -> CheckedStore:
    kwargs: dict[str, Any] = {
        "max_batch_keys": config.max_transfer_blocks,
        "retry_interval_s": config.store_retry_interval_s,
    }
    if "call_timeout_s" in inspect.signature(CheckedStore).parameters:
        kwargs["call_timeout_s"] = config.store_call_timeout_s
    return CheckedStore(backend, **kwargs)


class ChaosEngine:
    """A pooled engine over its own Mooncake client. `gate` stops a transfer at a chosen call,
    `faults` injects failures and logs every call (put-start keys for the leak check)."""

    def __init__(
        self,
        mooncake_config: dict[str, Any],
        layerkv: dict[str, Any],
        announce: Announce,
        model_id: str,
        model: ModelConfig = MODEL,
        engine: EngineConfig = ENGINE,
    ) -> None:
        from layerkv.store.mooncake import MooncakeStore

        self.client = MooncakeStore.from_mooncake_config(mooncake_config)
        self.gate = Gate(self.client, announce)
        self.faults = FaultyStore(self.gate)
        self.config = make_config(layerkv)
        self.stores: list[CheckedStore] = []

        def factory() -> CheckedStore:
            self.stores.append(checked_store(self.faults, self.config))
            return self.stores[-1]

        engine = dataclasses.replace(engine, model_id=model_id)  # the round's namespace (keys of no other round)
        self.engine: Engine = pooled_engine(model, engine, self.config, store_factory=factory)
        self._closed = False

    @property
    def workers(self) -> list[Any]:
        return list(self.engine.runner.worker_hooks)

    def serve(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[dict[str, Any]]:
        """Each prompt alone, timed; an exception out of the engine is an output with `error`."""
        return [serve_one(self.engine, prompt, max_tokens) for prompt in prompts]

    def status(self, idle_timeout_s: float = 5.0) -> dict[str, Any]:
        """Sessions left (None on a layerkv without is_idle), stats, the keys put-started."""
        idle = [w.is_idle(idle_timeout_s) if hasattr(w, "is_idle") else None for w in self.workers]
        return {
            "idle": idle,
            "open_sessions": [w.open_sessions() if hasattr(w, "open_sessions") else None for w in self.workers],
            "stats": [w.stats().as_dict() for w in self.workers],
            "put_keys": sorted(set(self.faults.keys_sent(PUT_START))),
            "get_keys": sorted(set(self.faults.keys_sent(GET_START))),
            # (keys, answers) of every put start that reached Mooncake
            "put_start_answers": [
                [list(c.keys), c.result] for c in self.faults.calls(PUT_START) if isinstance(c.result, list)
            ],
            "outage_answers": sum(
                1
                for c in self.faults.calls()
                if isinstance(c.result, list) and any(code in (-900, -901) for code in c.result)
            ),
            "put_start_901_calls": sum(
                1 for c in self.faults.calls(PUT_START) if isinstance(c.result, list) and -901 in c.result
            ),
            # keys Mooncake's own client answered -901 for (it gave up; the master may act later)
            "mooncake_901_keys": sorted(
                {
                    k
                    for c in self.faults.calls()
                    if isinstance(c.result, list)
                    for k, code in zip(c.keys, c.result)
                    if code == -901
                }
            ),
            "has_work": self.engine.has_work(),
            "slow_calls": list(self.gate.slow_calls),
            # staging bytes still lent to unfinished jobs (None on a layerkv without gauges)
            "staging_bytes_in_use": [
                w.gauges()["staging_bytes_in_use"] if hasattr(w, "gauges") else None for w in self.workers
            ],
        }

    def wait_store_up(self, timeout_s: float) -> bool:
        """Until every connector's store answers again (each probes after its retry interval;
        a client's first call after a master restart may fail once more on its old connection)."""
        deadline = time.monotonic() + timeout_s
        for store in self.stores:
            while store.batch_is_exist(["chaos-up-probe"]) != [0]:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)  # the store's retry interval decides; nothing to wait on
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.gate.open()
        try:
            self.engine.shutdown()
        finally:
            self.client.close()


def serve_one(engine: Engine, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    start = time.monotonic()
    first_step = len(engine.steps)
    try:
        out = engine.generate([list(prompt)], max_tokens)[0]
    except Exception as exc:  # noqa: BLE001 - reported: the test asserts there is none
        return {
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "error": f"{type(exc).__name__}: {exc}",
            "wall_s": time.monotonic() - start,
        }
    wall_s = time.monotonic() - start
    return {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "error": None,
        "tokens": list(out.token_ids),
        "logits": encode_logits(out.logits),
        "external": out.num_external_tokens,
        "chunks": computed_chunks(engine, out.req_id),
        "wall_s": wall_s,
        "ttft_s": out.first_token_time_s - out.arrival_time_s,
        "step_s": [round(s.duration_s, 3) for s in engine.steps[first_step:]],
        "end_unix_s": time.time(),  # wall clock (shared by the processes of a round)
    }


def encode_logits(logits: Sequence[Any]) -> str:
    """float32 bytes of every token's logits, concatenated, base64 (bit-exact)."""
    return base64.b64encode(b"".join(row.contiguous().numpy().tobytes() for row in logits)).decode()


def computed_chunks(engine: Engine, req_id: str) -> list[list[int]]:
    """(first token, num tokens) computed per kept step of `req_id`."""
    return [
        [r.num_computed_tokens, r.num_scheduled_tokens]
        for s in engine.steps
        for r in s.requests
        if r.req_id == req_id and r.req_id not in s.discarded_req_ids
    ]


class LocalOracle:
    """The local run: the same model and engine config, no pool. Outputs are cached per prompt
    (each prompt's bits do not depend on what ran before, see the module docstring)."""

    def __init__(self, model: ModelConfig = MODEL, engine: EngineConfig = ENGINE) -> None:
        self._engine = Engine(model, dataclasses.replace(engine, num_blocks=512))
        self._cache: dict[tuple[tuple[int, ...], int], dict[str, Any]] = {}

    def output(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            self._cache[key] = serve_one(self._engine, prompt, max_tokens)
        return self._cache[key]

    def close(self) -> None:
        self._engine.shutdown()


Serve = Callable[[Sequence[Sequence[int]], int], list[dict[str, Any]]]
