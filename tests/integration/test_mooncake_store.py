"""MooncakeStore against a real mooncake_master on loopback: per-layer ranges, the session
semantics and result codes layerkv relies on, placement, version/method checks, startup
failures, and a master restart."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError, StoreError, StoreVersionError
from layerkv.store.base import SESSION_METHODS, Code, Placement
from layerkv.store.mooncake_master import MIN_SEGMENT_BYTES
from tests.mooncake_master import MooncakeHarness, connect_store, require_mooncake, start_master

pytestmark = pytest.mark.mooncake

HEADER_NBYTES = 64
ENTRY_NBYTES = (1024, 512)  # per layer: K and V of different sizes
NUM_LAYERS = 4
LAYER_NBYTES = sum(ENTRY_NBYTES)
OBJECT_NBYTES = HEADER_NBYTES + NUM_LAYERS * LAYER_NBYTES


def entry_offset(layer_idx: int, entry_idx: int) -> int:
    return HEADER_NBYTES + layer_idx * LAYER_NBYTES + sum(ENTRY_NBYTES[:entry_idx])


class Buffers:
    """One registered host buffer per key (object image), released by `close`."""

    def __init__(self, store: Any, num_keys: int, seed: int | None) -> None:
        rng = np.random.default_rng(seed)
        self.store = store
        self.arrays = [
            rng.integers(0, 256, OBJECT_NBYTES, dtype=np.uint8)
            if seed is not None
            else np.zeros(OBJECT_NBYTES, np.uint8)
            for _ in range(num_keys)
        ]  # each: [OBJECT_NBYTES] uint8
        for array in self.arrays:
            store.register_buffer(array.ctypes.data, array.nbytes)

    def layer_ranges(self, layer_idx: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        offsets = [entry_offset(layer_idx, e) for e in range(len(ENTRY_NBYTES))]
        ptrs = [[a.ctypes.data + off for off in offsets] for a in self.arrays]
        sizes = [list(ENTRY_NBYTES) for _ in self.arrays]
        return ptrs, sizes, [list(offsets) for _ in self.arrays]

    def close(self) -> None:
        for array in self.arrays:
            self.store.unregister_buffer(array.ctypes.data)


def unique_keys(prefix: str, n: int) -> list[str]:
    stamp = time.monotonic_ns()
    return [f"test@{prefix}-{stamp}-{i}@0" for i in range(n)]


def test_round_trip_per_layer_ranges(mooncake_harness: MooncakeHarness) -> None:
    writer, reader = mooncake_harness.store, mooncake_harness.new_client(0)
    keys = unique_keys("rt", 3)
    src, dst = Buffers(writer, 3, seed=1), Buffers(reader, 3, seed=None)
    assert writer.batch_put_session_start(keys, [OBJECT_NBYTES] * 3) == [0, 0, 0]
    for layer_idx in range(NUM_LAYERS):
        ptrs, sizes, offsets = src.layer_ranges(layer_idx)
        assert writer.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets) == [LAYER_NBYTES] * 3
    assert writer.batch_put_session_end(keys) == [0, 0, 0]
    assert reader.batch_is_exist(keys) == [1, 1, 1]
    assert reader.batch_get_session_start(keys) == [0, 0, 0]
    for layer_idx in reversed(range(NUM_LAYERS)):  # any order: ranges are independent
        ptrs, sizes, offsets = dst.layer_ranges(layer_idx)
        assert reader.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets) == [LAYER_NBYTES] * 3
    assert reader.batch_get_session_end(keys) == 0
    for a, b in zip(src.arrays, dst.arrays):
        assert np.array_equal(a[HEADER_NBYTES:], b[HEADER_NBYTES:])
    assert writer.batch_remove(keys) == [0, 0, 0]
    src.close()
    dst.close()


def test_session_codes(mooncake_harness: MooncakeHarness) -> None:
    store = mooncake_harness.store
    keys = unique_keys("codes", 2)
    buf = Buffers(store, 1, seed=2)
    ptr = buf.arrays[0].ctypes.data
    assert store.batch_get_session_start([keys[0]]) == [Code.OBJECT_NOT_FOUND]
    assert store.batch_put_session_start([keys[0]], [0]) == [Code.INVALID_PARAMS]  # zero size
    assert store.batch_put_session_start(keys, [4096, 4096]) == [0, 0]
    assert store.batch_put_session_start([keys[0]], [4096]) == [Code.INVALID_PARAMS]  # same client twice
    assert store.batch_is_exist(keys) == [0, 0]  # PROCESSING is not readable
    assert store.batch_get_session_start([keys[0]]) == [Code.REPLICA_NOT_READY]
    assert store.batch_put_from_multi_buffer_ranges([keys[0]], [[ptr]], [[200]], [[4000]]) == [Code.INVALID_PARAMS]
    assert store.batch_put_from_multi_buffer_ranges([keys[0]], [[ptr]], [[4096]], [[0]]) == [4096]
    assert store.batch_put_session_end([keys[0]]) == [0]
    assert store.batch_put_session_revoke([keys[1]]) == [0]
    assert store.batch_is_exist(keys) == [1, 0]
    assert store.batch_put_session_start([keys[0]], [4096]) == [Code.OBJECT_EXISTS]
    assert store.batch_put_from_multi_buffer_ranges([keys[1]], [[ptr]], [[16]], [[0]]) == [Code.INVALID_PARAMS]
    assert store.batch_get_into_multi_buffer_ranges([keys[0]], [[ptr]], [[16]], [[0]]) == [Code.INVALID_PARAMS]
    assert store.batch_get_session_start([keys[0]]) == [0]
    assert store.batch_get_into_multi_buffer_ranges([keys[0]], [[ptr]], [[200]], [[4000]]) == [Code.INVALID_PARAMS]
    assert store.batch_get_session_end([keys[0], "never-started"]) == 0
    assert store.batch_remove([keys[0]]) == [0]
    buf.close()


def test_second_client_put_start_on_held_key_is_705(mooncake_harness: MooncakeHarness) -> None:
    first, second = mooncake_harness.store, mooncake_harness.new_client(0)
    key = unique_keys("race", 1)
    assert first.batch_put_session_start(key, [4096]) == [0]
    assert second.batch_put_session_start(key, [4096]) == [Code.OBJECT_EXISTS]
    assert first.batch_put_session_revoke(key) == [0]
    assert second.batch_put_session_start(key, [4096]) == [0]  # free again after the revoke
    assert second.batch_put_session_revoke(key) == [0]


def test_whole_object_put_get_remove(mooncake_harness: MooncakeHarness) -> None:
    store = mooncake_harness.store
    keys = unique_keys("whole", 2)
    src, dst = Buffers(store, 2, seed=3), Buffers(store, 2, seed=None)
    assert store.batch_put_from(keys, [a.ctypes.data for a in src.arrays], [OBJECT_NBYTES] * 2) == [0, 0]
    assert store.batch_get_into(keys, [a.ctypes.data for a in dst.arrays], [OBJECT_NBYTES] * 2) == [OBJECT_NBYTES] * 2
    assert all(np.array_equal(a, b) for a, b in zip(src.arrays, dst.arrays))
    assert store.batch_remove(keys) == [0, 0]
    assert store.batch_is_exist(keys) == [0, 0]
    src.close()
    dst.close()


class RecordingClient:
    """Mixin making a thin recording subclass of the real client class."""

    def __init__(self) -> None:
        super().__init__()
        self.configs: list[Any] = []

    def batch_put_session_start(self, keys: list[str], sizes: list[int], config: Any) -> list[int]:
        self.configs.append(config)
        return super().batch_put_session_start(keys, sizes, config)  # type: ignore[misc, no-any-return]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any) -> list[int]:
        self.configs.append(config)
        return super().batch_put_from(keys, ptrs, sizes, config)  # type: ignore[misc, no-any-return]


def test_placement_reaches_the_client(mooncake_harness: MooncakeHarness) -> None:
    from mooncake.store import MooncakeDistributedStore

    recording_cls = type("RecordingStore", (RecordingClient, MooncakeDistributedStore), {})
    holder = mooncake_harness.store
    default = Placement(replica_num=1, preferred_segment="", prefer_alloc_in_same_node=True)
    store = mooncake_harness.new_client(0, placement=default, client_cls=recording_cls)
    client = store._client
    keys = unique_keys("place", 2)
    wanted = Placement(replica_num=1, preferred_segment=holder.segment_name, prefer_alloc_in_same_node=False)
    assert store.batch_put_session_start(keys[:1], [4096], wanted) == [0]
    assert store.batch_put_session_start(keys[1:], [4096]) == [0]  # no placement: the store's default
    buf = Buffers(store, 1, seed=4)
    assert store.batch_put_from([keys[0] + "w"], [buf.arrays[0].ctypes.data], [4096], wanted) == [0]
    seen = [(c.replica_num, c.preferred_segment, c.prefer_alloc_in_same_node) for c in client.configs]
    assert seen == [(1, holder.segment_name, False), (1, "", True), (1, holder.segment_name, False)]
    assert store.batch_put_session_revoke(keys) == [0, 0]
    assert store.batch_remove([keys[0] + "w"]) == [0]
    buf.close()


def test_missing_methods_named_in_one_error(mooncake_master: Any) -> None:
    lacking = ("batch_put_from_multi_buffer_ranges", "batch_get_session_end")
    methods = {name: (lambda self, *a: 0) for name in SESSION_METHODS if name not in lacking}
    old_cls = type("OldMooncakeClient", (), methods)
    with pytest.raises(StoreVersionError, match=r"batch_put_from_multi_buffer_ranges, batch_get_session_end.*0\.3\.13"):
        connect_store(mooncake_master, client_cls=old_cls)


def test_version_check() -> None:
    from layerkv.store.mooncake import check_version, installed_version

    with pytest.raises(StoreVersionError, match=r"mooncake 0\.3\.12\.post2 is installed; .*>= 0\.3\.13"):
        check_version("0.3.12.post2")
    check_version("0.3.13.post1")
    check_version("0.4.0")
    require_mooncake()
    assert installed_version() is not None


def test_setup_against_stopped_master_fails_fast() -> None:
    require_mooncake()
    master = start_master()
    master.stop()
    began = time.monotonic()
    with pytest.raises(StoreError, match=rf"mooncake master at {master.address} is not reachable"):
        connect_store(master)
    assert time.monotonic() - began < 5.0


def test_segment_below_16_mib_fails_with_rc(mooncake_master: Any) -> None:
    with pytest.raises(
        StoreError, match=rf"against master {mooncake_master.address} failed: rc=INVALID_PARAMS\(-600\).*16 MiB"
    ):
        connect_store(mooncake_master, 8 << 20)


def test_from_config_file_and_master_override(mooncake_master: Any, tmp_path: Any) -> None:
    from layerkv.store.mooncake import MooncakeStore

    file_config = dict(mooncake_master.config(global_segment_size="16MB", local_buffer_size="16 MiB"))
    file_config["master_server_address"] = "127.0.0.1:1"  # wrong on purpose: the override wins
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(file_config))
    config = LayerKVConfig.from_dict(
        {"backend": "mooncake", "mooncake_config_path": str(path), "prefer_alloc_in_same_node": True},
        env={"MOONCAKE_MASTER": mooncake_master.address},
    )
    store = MooncakeStore.from_config(config)
    try:
        assert store.master_address == mooncake_master.address
        assert store.default_placement == Placement(1, "", True)
        assert store.batch_is_exist(["test@absent@0"]) == [0]
    finally:
        store.close()
    with pytest.raises(StoreError, match=r"MooncakeStore.batch_is_exist called after close"):
        store.batch_is_exist(["k"])


def test_config_parsing() -> None:
    from layerkv.store.mooncake_config import parse_size, setup_args

    assert parse_size("512MB", "k") == 512 << 20
    assert parse_size("1GB", "k") == 1 << 30
    assert parse_size(" 2 gib ", "k") == 2 << 30
    assert parse_size(4096, "k") == 4096
    with pytest.raises(ConfigError, match=r"global_segment_size='lots' must be bytes"):
        parse_size("lots", "global_segment_size")
    with pytest.raises(ConfigError, match=r"lacks required key\(s\) metadata_server, master_server_address"):
        setup_args({"local_hostname": "127.0.0.1"})
    args = setup_args(
        {
            "local_hostname": "h",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": "m:1",
            "device_name": "mlx5_0",
            "global_segment_size": "1GB",
        },
        master_address="n:2",
    )
    assert (args["master_server_addr"], args["rdma_devices"], args["global_segment_size"]) == ("n:2", "mlx5_0", 1 << 30)
    assert args["tenant_id"] == "default"
    base = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE", "master_server_address": "m:1"}
    assert setup_args({**base, "tenant_id": "file-t"})["tenant_id"] == "file-t"
    assert setup_args({**base, "tenant_id": "file-t"}, tenant_id="tenant-a")["tenant_id"] == "tenant-a"


def test_loopback_bind_address_set_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from layerkv.store.mooncake_config import bind_loopback_if_local

    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    bind_loopback_if_local("10.0.0.5")
    assert "MC_TCP_BIND_ADDRESS" not in __import__("os").environ
    bind_loopback_if_local("localhost")
    assert __import__("os").environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.2")
    bind_loopback_if_local("127.0.0.1")
    assert __import__("os").environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.2"


def test_master_restart_fails_fast_then_recovers_empty() -> None:
    require_mooncake()
    harness = MooncakeHarness(start_master())
    try:
        store = harness.store
        key = unique_keys("restart", 1)
        buf = Buffers(store, 1, seed=5)
        assert store.batch_put_from(key, [buf.arrays[0].ctypes.data], [4096]) == [0]
        harness.master.stop()
        # Observed on 0.3.13.post1: a call while the master is down returns -900 either at once
        # or after ~4.4 s spent reconnecting (most calls after the first). Never a hang.
        for call in (lambda: store.batch_is_exist(key), lambda: store.batch_get_session_start(key)):
            began = time.monotonic()
            assert call() == [Code.RPC_FAIL]
            assert time.monotonic() - began < 10.0
        harness.master.start()
        deadline = time.monotonic() + 15.0
        while (answer := store.batch_is_exist(key)) == [Code.RPC_FAIL] and time.monotonic() < deadline:
            time.sleep(0.1)  # polling an external process with a deadline
        assert answer == [0]  # the object is gone: no HA
        # The client re-mounts its segment once it has reconnected; until then puts find no space.
        while (answer := store.batch_put_from(key, [buf.arrays[0].ctypes.data], [4096])) != [0]:
            assert answer[0] in (Code.NO_SPACE, Code.RPC_FAIL) and time.monotonic() < deadline, answer
            time.sleep(0.1)  # polling an external process with a deadline
        assert store.batch_is_exist(key) == [1]
        buf.close()
    finally:
        harness.close()
        harness.master.stop()


def test_make_store_capacity_and_lease(mooncake_harness: MooncakeHarness) -> None:
    store = mooncake_harness.make_store(capacity_bytes=MIN_SEGMENT_BYTES, lease_ttl_s=0.5)
    key = unique_keys("lease", 1)
    assert store.batch_put_session_start(key, [MIN_SEGMENT_BYTES + 4096]) == [Code.NO_SPACE]
    buf = Buffers(store, 1, seed=6)
    ptr = buf.arrays[0].ctypes.data
    assert store.batch_put_from(key, [ptr], [4096]) == [0]
    assert store.batch_get_session_start(key) == [0]
    deadline = time.monotonic() + 10.0
    while (answer := store.batch_get_into_multi_buffer_ranges(key, [[ptr]], [[16]], [[0]])) == [16]:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)  # polling the lease clock with a deadline
    assert answer == [Code.LEASE_EXPIRED]
    assert store.batch_get_into_multi_buffer_ranges(key, [[ptr]], [[16]], [[0]]) == [Code.INVALID_PARAMS]  # dropped
    assert store.batch_get_session_end(key) == 0
    buf.close()


class _StalledClient:
    """A real Mooncake client whose batch_is_exist stalls until released (a read to a host that
    vanished: a cut link sends no reset); every other attribute is the client's own."""

    def __init__(self, client: Any) -> None:
        import threading

        self._client = client
        self.inside, self.release = threading.Event(), threading.Event()
        self.closed = 0

    def batch_is_exist(self, keys: Any) -> Any:
        self.inside.set()
        assert self.release.wait(30), "the test never released the stalled call"
        return self._client.batch_is_exist(keys)

    def close(self) -> Any:
        self.closed += 1
        return self._client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _a_call_inside(harness: MooncakeHarness, key: str) -> tuple[Any, _StalledClient, Any]:
    """A fresh store whose client holds a batch_is_exist of `key` (on a thread) until released."""
    import threading

    store = harness.new_client()
    stalled = _StalledClient(store._client)
    store._client = stalled
    caller = threading.Thread(target=store.batch_is_exist, args=([key],), name=f"call-{key}")
    caller.start()
    assert stalled.inside.wait(10)
    return store, stalled, caller


def test_close_never_tears_the_client_down_under_a_call(mooncake_harness: MooncakeHarness) -> None:
    import threading

    store, stalled, caller = _a_call_inside(mooncake_harness, "close-under-a-call")
    store.close(wait_s=0.3)  # the call is still inside: the client is left open
    assert stalled.closed == 0
    with pytest.raises(StoreError, match="after close"):
        store.batch_is_exist(["k"])  # closed to new calls all the same
    stalled.release.set()
    caller.join(10)
    closer = threading.Thread(target=store.close)  # idempotent: the first close decided
    closer.start()
    closer.join(10)
    assert stalled.closed == 0
    stalled._client.close()  # what the process would drop at exit; the harness's close is a no-op now


def test_close_waits_for_a_call_that_returns(mooncake_harness: MooncakeHarness) -> None:
    import threading

    store, stalled, caller = _a_call_inside(mooncake_harness, "close-after-a-call")
    threading.Timer(0.3, stalled.release.set).start()
    store.close(wait_s=10)  # returns once the call came back, then closes
    caller.join(10)
    assert stalled.closed == 1
