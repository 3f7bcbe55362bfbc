"""`layerkv doctor --device DEVICE`: a KV round trip with the caches on DEVICE, through layerkv's
real data path (pinned host staging, side-stream copies on CUDA, per-layer checks): a small
reference engine (bf16 on an accelerator) saves a prompt's KV into the store, a fresh engine
loads it, and its output must equal computing locally on the same device. The store is the
Mooncake deployment of --config, else an embedded one. Main thread only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from layerkv.commands.check_result import CheckResult
from layerkv.config import LayerKVConfig
from layerkv.errors import LayerKVError

if TYPE_CHECKING:
    from layerkv.engine import EngineConfig, ModelConfig, RequestOutput

BLOCK = 16
PROMPT_BLOCKS = 4


def unavailable(device: str) -> str | None:
    """Why `device` cannot be used here (None: it can)."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"--device {device}: only cpu and cuda (cuda:N) are checked"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"
    index = device.partition(":")[2]
    if index and not index.isdigit():
        return f"--device {device}: the CUDA device is cuda or cuda:N (N a device index)"
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        return (
            f"--device {device}: torch sees {count} CUDA device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})"
        )
    return None


def check_device(device: str, mooncake_config: str | None) -> CheckResult:
    """Producer saves, a fresh consumer loads, its logits equal local compute; bytes and time."""
    name = f"device round trip ({device})"
    why = unavailable(device)
    if why is not None:
        return CheckResult(name, False, why)
    model, engine_config = _small_engine(device)
    config = _pool_config(mooncake_config)
    prompt = [(7 * i + 3) % model.vocab_size for i in range(PROMPT_BLOCKS * BLOCK + 1)]
    began = time.monotonic()
    try:
        got, want, loaded = _round_trip(model, engine_config, config, prompt)
    except LayerKVError as exc:
        return CheckResult(name, False, f"raised {exc}")
    if got.num_external_tokens != PROMPT_BLOCKS * BLOCK or loaded == 0:
        return CheckResult(
            name,
            False,
            f"the consumer loaded {got.num_external_tokens} tokens ({loaded} bytes), expected {PROMPT_BLOCKS * BLOCK}",
        )
    if not all(torch.equal(a, b) for a, b in zip(got.logits, want.logits)):
        return CheckResult(name, False, "the loaded KV gave other logits than local compute")
    return CheckResult(
        name,
        True,
        f"{PROMPT_BLOCKS} blocks x {model.num_layers} layers ({loaded} bytes, {model.dtype}) "
        f"saved, loaded and equal to local compute in {time.monotonic() - began:.2f} s",
    )


def _small_engine(device: str) -> tuple[ModelConfig, EngineConfig]:
    """A small reference model (bf16 on an accelerator) and an engine on `device` in a namespace of its own."""
    from layerkv.engine import EngineConfig, ModelConfig

    model = ModelConfig(
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=512,
        seed=3,
        dtype="float32" if device == "cpu" else "bfloat16",
    )
    engine_config = EngineConfig(
        block_size=BLOCK,
        num_blocks=32,
        max_num_batched_tokens=256,
        device=device,
        model_id=f"layerkv/doctor-{time.time_ns()}",
    )  # a namespace of its own
    return model, engine_config


def _pool_config(mooncake_config: str | None) -> LayerKVConfig:
    """The Mooncake deployment of `mooncake_config`, else an embedded store."""
    settings: dict[str, Any] = {"transfer_plan": "groups", "embedded_capacity_bytes": 64 << 20}
    if mooncake_config:
        settings.update(backend="mooncake", mooncake_config_path=mooncake_config)
    return LayerKVConfig.from_dict(settings, env={})


def _round_trip(
    model: ModelConfig, engine_config: EngineConfig, config: LayerKVConfig, prompt: list[int]
) -> tuple[RequestOutput, RequestOutput, int]:
    """(the consumer's output, local compute's, the bytes the consumer loaded) after a producer saved
    `prompt`; every engine shut down and every store closed, whatever raised (LayerKVError passes)."""
    from layerkv.engine.engine import Engine
    from layerkv.engine.pooled import pooled_engine
    from layerkv.store.factory import open_checked_store

    engines: list[Engine] = []
    stores: list[Any] = []

    def store() -> Any:  # one client per connector (the embedded store is one per process)
        stores.append(open_checked_store(config))
        return stores[-1]

    try:
        producer = pooled_engine(model, engine_config, config, store_factory=store)
        engines.append(producer)
        producer.generate([prompt], 1)
        consumer = pooled_engine(model, engine_config, config, store_factory=store)
        engines.append(consumer)
        got = consumer.generate([prompt], 1)[0]
        local = Engine(model, engine_config)
        engines.append(local)
        local.generate([prompt], 1)  # as the producer computed it; the second run hits its own prefix cache
        want = local.generate([prompt], 1)[0]
        loaded = sum(w.stats().loaded_bytes for w in consumer.runner.worker_hooks)  # type: ignore[attr-defined]
    finally:
        for engine in engines:
            engine.shutdown()
        for opened in stores:
            opened.close()
    return got, want, loaded
