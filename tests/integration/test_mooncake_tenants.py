"""Mooncake tenants and quotas on a real multi-tenant master: layerkv's client claims its tenant
(config mooncake_tenant_id, default the tenant label); another tenant's client neither sees nor
removes its objects; a tenant the master does not list cannot write; a put past a tenant's quota
fails. `layerkv master --tenant NAME=SIZE` starts such a master. (Mooncake does not authenticate
tenant ids: a client claiming tenant-a is tenant-a, docs/security.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError
from layerkv.store.base import Code
from layerkv.store.mooncake import MooncakeStore
from layerkv.store.mooncake_master import write_tenant_quotas
from tests.mooncake_master import require_mooncake, start_master

MiB = 1 << 20


def _client(config_path: Path, **layerkv: str) -> MooncakeStore:
    return MooncakeStore.from_config(
        LayerKVConfig.from_dict({"backend": "mooncake", "mooncake_config_path": str(config_path), **layerkv}, env={})
    )


def test_tenants_keep_their_objects_apart_and_within_their_quota(tmp_path: Path) -> None:
    require_mooncake()
    master = start_master(tenant_quotas={"tenant-a": 8 * MiB, "tenant-b": 2 * MiB})
    clients: list[MooncakeStore] = []
    try:
        clients.append(
            MooncakeStore.from_mooncake_config(master.config(global_segment_size=64 * MiB), tenant_id="tenant-a")
        )
        config_path = tmp_path / "mooncake.json"
        config_path.write_text(json.dumps(master.config(global_segment_size=0)))
        a = _client(config_path, tenant="tenant-a")  # the tenant label is the Mooncake tenant
        b = _client(config_path, tenant="other-label", mooncake_tenant_id="tenant-b")
        stranger = _client(config_path, tenant="tenant-c")
        clients += [a, b, stranger]
        buf = np.arange(4 * MiB, dtype=np.uint8)
        for c in (a, b, stranger):
            c.register_buffer(buf.ctypes.data, buf.nbytes)
        assert a.batch_put_from(["k"], [buf.ctypes.data], [MiB]) == [0]
        assert a.batch_is_exist(["k"]) == [1]
        assert b.batch_is_exist(["k"]) == [0]  # another tenant's object does not exist for b
        assert b.batch_remove(["k"]) == [int(Code.OBJECT_NOT_FOUND)] and a.batch_is_exist(["k"]) == [1]
        assert stranger.batch_put_from(["s"], [buf.ctypes.data], [MiB]) == [int(Code.TENANT_NOT_REGISTERED)]
        assert b.batch_put_from(["big"], [buf.ctypes.data], [3 * MiB]) == [int(Code.TENANT_QUOTA_EXCEEDED)]
        out = np.zeros(MiB, dtype=np.uint8)
        a.register_buffer(out.ctypes.data, out.nbytes)
        assert a.batch_get_into(["k"], [out.ctypes.data], [MiB]) == [MiB] and np.array_equal(out, buf[:MiB])
    finally:
        for c in clients:
            c.close()
        master.stop()


def test_tenant_quota_files_refuse_bad_names_and_sizes(tmp_path: Path) -> None:
    path = write_tenant_quotas(tmp_path / "q.yaml", {"a": 1, "b-2": 5 * MiB})
    assert json.loads(path.read_text()) == {
        "version": 1,
        "tenants": [{"name": "a", "quota": 1}, {"name": "b-2", "quota": 5 * MiB}],
    }
    for bad in ({"": 1}, {"_x": 1}, {"a\n": 1}, {"a": 0}, {"a": True}):
        with pytest.raises(ConfigError, match="tenant"):
            write_tenant_quotas(tmp_path / "bad.yaml", bad)  # type: ignore[arg-type]
