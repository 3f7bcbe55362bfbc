"""The worker's side of the commit protocol and its failure paths: saves wait for a verdict,
nothing raised into the engine, nothing leaked (an exception after put start, a stalled save, a
verdict that never comes, shutdown), get sessions renewed before their lease ends, and the
device code path (torch views and copies) on CPU tensors."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from layerkv.config import LayerKVConfig
from layerkv.connector.worker import WorkerConnector
from layerkv.errors import ConfigError, LayoutError
from layerkv.messages import Deployment
from layerkv.objects.layout import CacheLayout
from layerkv.objects.seal import Sealer, context
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore
from layerkv.store.faults import GET_RANGES, PUT_RANGES, PUT_REVOKE
from layerkv.transfer.views import CacheViews
from tests.backends import Backend, EmbeddedBackend, MooncakeBackend
from tests.connector.rig import BLOCK_SIZE, Req, Rig
from tests.tokens import block_tokens


def test_saves_are_readable_only_after_the_next_steps_verdict(make_rig) -> None:
    rig = make_rig()
    a = Req("a", block_tokens(3, BLOCK_SIZE))
    _, s = rig.admit(a)
    rig.step([s])
    keys = rig.keys(a)
    assert rig.pool_exists(keys) == [0, 0, 0]  # written, waiting for the verdict
    assert rig.workers[0].open_sessions()["pending_puts"] == 3
    rig.settle()  # the next step carries the verdict
    assert rig.pool_exists(keys) == [1, 1, 1]
    assert rig.workers[0].stats().committed_keys == 3


def test_an_exception_after_put_start_revokes_everything(make_rig, backend, monkeypatch) -> None:
    from layerkv.objects.header import Header

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("header encoder broke")

    rig = make_rig()
    a = Req("a", block_tokens(4, BLOCK_SIZE))
    monkeypatch.setattr(Header, "encode_into", broken)
    rig.run(a)  # nothing raised into the engine
    monkeypatch.undo()
    keys = rig.keys(a)
    assert rig.workers[0].is_idle(5.0)
    assert backend.processing_keys(keys) == [] and rig.pool_exists(keys) == [0] * 4
    assert sorted(rig.faults[0].keys_sent(PUT_REVOKE)) == sorted(keys)
    assert rig.workers[0].stats().transfer_errors == 1


def test_a_stalled_save_is_revoked_and_the_step_goes_on(make_rig, backend) -> None:
    rig = make_rig(save_timeout_s=0.5)
    a = Req("a", block_tokens(4, BLOCK_SIZE))
    rig.faults[0].delay(PUT_RANGES, 30.0, layer_idx=1, times=1)
    start = time.monotonic()
    _, s = rig.admit(a)
    rig.step([s])  # wait_for_save gives up after 0.5 s
    assert time.monotonic() - start < 5.0
    assert rig.workers[0].stats().save_timeouts == 1
    rig.faults[0].release()
    assert rig.workers[0].is_idle(5.0)
    rig.settle()
    keys = rig.keys(a)
    assert backend.processing_keys(keys) == [] and rig.pool_exists(keys) == [0] * 4


def test_a_verdict_that_never_comes_revokes_after_commit_timeout(make_rig, backend) -> None:
    rig = make_rig(commit_timeout_s=1.0)
    a = Req("a", block_tokens(3, BLOCK_SIZE))
    _, s = rig.admit(a)
    rig.step([s])
    worker = rig.workers[0]
    assert worker.open_sessions()["pending_puts"] == 3
    worker.commits.expire()  # what the idle write thread runs: too early, nothing expires
    assert worker.open_sessions()["pending_puts"] == 3
    worker.commits.pending._clock = lambda: time.monotonic() + 2.0  # the verdict is now 2 s late
    worker.commits.expire()
    assert worker.open_sessions()["pending_puts"] == 0 and worker.stats().revoked_unsettled == 3
    assert backend.processing_keys(rig.keys(a)) == []
    rig.settle()  # a late verdict for a step already revoked is harmless
    assert rig.pool_exists(rig.keys(a)) == [0, 0, 0]


def test_shutdown_revokes_what_waits_for_a_verdict(make_rig, backend) -> None:
    rig = make_rig()
    a = Req("a", block_tokens(3, BLOCK_SIZE))
    _, s = rig.admit(a)
    rig.step([s])
    worker = rig.workers[0]
    worker.shutdown()
    assert worker.stats().revoked_on_shutdown == 3
    assert backend.processing_keys(rig.keys(a)) == [] and rig.pool_exists(rig.keys(a)) == [0, 0, 0]
    rig.finished.add("a")  # nothing left to drain


@pytest.mark.parametrize("backend_name", ["embedded", "mooncake"])
@pytest.mark.parametrize("renew_after_s", [0.4, 100.0])
def test_a_step_longer_than_the_lease_renews_its_sessions(request, backend_name: str, renew_after_s: float) -> None:
    store_backend: Backend
    if backend_name == "embedded":
        store_backend = EmbeddedBackend(lease_ttl_s=1.0)
    else:
        harness = request.getfixturevalue("mooncake_harness")
        store_backend = MooncakeBackend.of(harness.make_store(64 << 20, lease_ttl_s=1.0))
    rig = Rig(
        store_backend,
        num_layers=4,
        prefetch_layers=1,
        load_timeout_s=5.0,
        lease_renew_after_s=renew_after_s,
        embedded_lease_ttl_s=1000.0,
    )  # the config's TTL; the backend above expires leases after 1 s
    try:
        tokens = block_tokens(4, BLOCK_SIZE)
        rig.run(Req("a", tokens))
        b = Req("b", tokens)
        _, s = rig.admit(b)
        rig.faults[0].delay(GET_RANGES, 0.45)  # every layer read is slow: the step takes ~1.8 s
        invalid = rig.step([s])
        rig.faults[0].clear_rules()
        stats = rig.workers[0].stats()
        if renew_after_s < 1.0:  # renewed before the 1 s lease ran out: every layer read
            assert invalid == set() and stats.lease_renewals >= 2, stats
            assert rig.wrong_blocks(b, range(4)) == []
        else:  # the control: without renewal the lease expires mid-step (-707) and blocks are recomputed
            assert invalid == set(b.block_ids[:4]) and stats.lease_renewals == 0, stats
        rig.drain()
    finally:
        rig.shutdown()
        store_backend.close()


def test_device_code_path_fans_out_with_torch_copies() -> None:
    caches = {f"model.layers.{li}.attn": torch.randn(2, 8, BLOCK_SIZE, 2, 4) for li in range(2)}
    layout = CacheLayout.from_caches(caches, 8, max_transfer_bytes=1 << 20)
    device_like = CacheViews(layout, caches, on_host=False)  # torch views, as on an accelerator
    host = CacheViews(layout, caches)
    device_like.copy_blocks(1, np.array([2, 2]), np.array([5, 6]))
    assert not torch.equal(
        caches["model.layers.0.attn"][:, 5], caches["model.layers.0.attn"][:, 2]
    )  # other layer untouched
    assert torch.equal(caches["model.layers.1.attn"][:, 5], caches["model.layers.1.attn"][:, 2])
    assert torch.equal(caches["model.layers.1.attn"][:, 6], caches["model.layers.1.attn"][:, 2])
    ctx = [context("k", bytes(16))]
    assert np.array_equal(
        host.tags(1, np.array([2]), ctx, Sealer(None)), host.tags(1, np.array([5]), ctx, Sealer(None))
    )


def test_bad_setups_are_rejected_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match=r"Deployment.block_size=0 must be an int >= 1"):
        Deployment(model_id="m", kv_dtype="float32", block_size=0, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"Deployment.block_size=-4 must be an int >= 1"):
        Deployment(model_id="m", kv_dtype="float32", block_size=-4, num_kv_heads=2)
    config = LayerKVConfig.from_dict({}, env={})
    deployment = Deployment(model_id="m", kv_dtype="float32", block_size=16, num_kv_heads=2, kv_signature="s")
    root = EmbeddedStore(64 << 20)
    with pytest.raises(TypeError, match="needs a CheckedStore"):
        WorkerConnector(config, deployment, root.client())  # type: ignore[arg-type]
    worker = WorkerConnector(config, deployment, CheckedStore(root.client(), max_batch_keys=64))
    try:
        caches = {"model.layers.0.attn": torch.zeros(2, 8, 4, 2, 8)}  # 4 tokens per block, not 16
        with pytest.raises(LayoutError, match=r"block_size=16 tokens appears in none of its dims"):
            worker.register_kv_caches(caches, 8)
        with pytest.raises(ConfigError, match=r"num_blocks=0 must be a positive int"):
            worker.register_kv_caches(caches, 0)
        on_device = {"model.layers.0.attn": torch.zeros(2, 8, 16, 2, 8, device="meta")}  # not host memory
        direct = WorkerConnector(
            LayerKVConfig.from_dict({"register_kv_cache": True}, env={}),
            deployment,
            CheckedStore(root.client(), max_batch_keys=64),
        )
        try:  # the live cache of a device is never handed to the store: device KV goes through staging
            with pytest.raises(
                ConfigError,
                match=r"register_kv_cache: true, but the KV caches live on meta: .*"
                r"Set register_kv_cache: false",
            ):
                direct.register_kv_caches(on_device, 8)
        finally:
            direct.shutdown()
    finally:
        worker.shutdown()
    small = config.replace(staging_nbytes=1 << 20)
    worker = WorkerConnector(small, deployment, CheckedStore(root.client(), max_batch_keys=64))
    try:  # staging is bounded: it must hold one object per side
        big = {f"model.layers.{li}.attn": torch.zeros(2, 4, 16, 8, 128) for li in range(9)}  # 64 KiB per layer-block
        with pytest.raises(
            ConfigError,
            match=r"staging_nbytes=1048576 must be >= 4720128 for this layout \(a quarter "
            r"of it, the loads' side, must hold one 1180032-byte object\); default is 512 MiB",
        ):
            worker.register_kv_caches(big, 4)
    finally:
        worker.shutdown()
        root.close()


@pytest.mark.parametrize("plan", ["auto", "whole"])
def test_staged_saves_never_make_the_forward_wait_for_the_store(make_rig, backend, plan: str) -> None:
    """Staged saves copy each layer into the object image; the put starts and writes go out
    after the forward released them: a write held until the test lets it go costs the step
    nothing (the step returns before it completed, and no save timed out)."""
    rig = make_rig(transfer_plan=plan, save_timeout_s=5.0)
    a = Req("a", block_tokens(4, BLOCK_SIZE))
    held = rig.faults[0].delay(PUT_RANGES, 30.0, times=1)
    start = time.monotonic()
    _, s = rig.admit(a)
    rig.step([s])
    assert rig.faults[0].fired(held) == 0, "the forward waited for the store"  # the held write has not returned
    assert time.monotonic() - start < 30.0 / 4
    assert rig.workers[0].stats().save_timeouts == 0
    rig.faults[0].release()
    rig.settle()  # waits for the background write, then commits
    assert rig.pool_exists(rig.keys(a)) == [1] * 4
    writes = rig.faults[0].calls(PUT_RANGES)
    assert sum(c.num_ranges for c in writes) == 4 and {c.layer_idx for c in writes} == {None}  # one image per key
    b = Req("b", block_tokens(4, BLOCK_SIZE))
    _, s = rig.admit(b)
    rig.poison(b)
    assert rig.step([s]) == set()
    assert rig.wrong_blocks(b, range(4)) == []


def test_a_failed_image_write_revokes_only_its_key(make_rig, backend) -> None:
    rig = make_rig(transfer_plan="auto")
    a = Req("a", block_tokens(5, BLOCK_SIZE))
    keys = rig.keys(a)
    rig.faults[0].fail(PUT_RANGES, keys[2])
    rig.run(a)
    assert rig.pool_exists(keys) == [1, 1, 0, 1, 1]
    assert rig.faults[0].keys_sent(PUT_REVOKE) == [keys[2]]
    assert backend.processing_keys(keys) == []
    stats = rig.workers[0].stats()
    assert (stats.committed_keys, stats.save_failed_keys) == (4, 1)


def test_a_staged_save_whose_step_is_abandoned_saves_nothing(make_rig, backend) -> None:
    rig = make_rig(transfer_plan="auto")
    a = Req("a", block_tokens(3, BLOCK_SIZE))
    _, s = rig.admit(a)
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    worker.save_kv_layer(rig.layer_name(0))
    worker.clear_connector_metadata()  # abandoned after layer 0: the job is cancelled
    assert worker.is_idle(5.0)
    assert rig.faults[0].calls(PUT_RANGES) == [] and backend.processing_keys(rig.keys(a)) == []
