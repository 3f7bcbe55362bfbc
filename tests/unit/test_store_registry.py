"""store/registry.py: built-in names and out-of-tree "module:Class" backends resolve to checked
classes; a config value that cannot name a backend, or a class that does not import or does not
meet the StoreBackend contract, is a ConfigError naming `backend`, the value and the fix."""

from __future__ import annotations

import re

import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError
from layerkv.store.base import HitSource, PoolScope
from layerkv.store.factory import open_store, pool_identity
from layerkv.store.process_stores import close_shared_stores
from layerkv.store.registry import BUILTIN_BACKENDS, backend_class
from tests.out_of_tree_store import SPEC, WrappedStore


def test_builtin_backends_resolve_with_their_properties() -> None:
    assert list(BUILTIN_BACKENDS) == ["embedded", "mooncake"]
    embedded, mooncake = backend_class("embedded"), backend_class("mooncake")
    assert (embedded.__name__, embedded.pool_scope, embedded.hit_source) == (
        "EmbeddedStore",
        PoolScope.PROCESS,
        HitSource.HOST,
    )
    assert (mooncake.__name__, mooncake.pool_scope, mooncake.hit_source) == (
        "MooncakeStore",
        PoolScope.SHARED,
        HitSource.P2P,
    )
    assert pool_identity(LayerKVConfig()) == "embedded|this-process|default|default"
    config = LayerKVConfig(backend="mooncake", mooncake_master="10.0.0.1:50051")
    assert pool_identity(config) == "mooncake|10.0.0.1:50051|default|default"


def test_an_out_of_tree_backend_named_by_config_opens_through_the_factory() -> None:
    config = LayerKVConfig.from_dict({"backend": SPEC}, env={})
    assert backend_class(SPEC) is WrappedStore
    first, second = open_store(config), open_store(config)
    try:
        assert isinstance(first, WrappedStore) and isinstance(second, WrappedStore) and first is not second
        assert first.batch_put_from(["k"], [0], [0]) == [-600]  # reached the embedded store (no buffer)
        assert first.calls["batch_put_from"] == 1 and second.calls == {}
        assert pool_identity(config) == f"{SPEC}|wrapped-in-this-process|default|default"
    finally:
        first.close()
        second.close()
        close_shared_stores()


@pytest.mark.parametrize("value", ["redis", "", "my.module", "my.module:", ":Cls", "a:b:c", "my-module:Cls", "m:C.x"])
def test_config_refuses_what_cannot_name_a_backend(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        LayerKVConfig.from_dict({"backend": value}, env={})
    assert str(info.value) == (
        f"backend={value!r} must be one of embedded, mooncake, or 'package.module:Class' (an out-of-tree store backend)"
    )


class MissingMethods:
    """Looks like a backend but stores nothing whole (no batch_put_from / batch_get_into / batch_remove)."""

    pool_scope = PoolScope.SHARED
    hit_source = HitSource.P2P


for _name in ("register_buffer", "unregister_buffer", "close", "from_config", "pool_address"):
    setattr(MissingMethods, _name, lambda *args: None)
for _name in WrappedStore.__dict__:
    if _name.startswith("batch_") and _name not in ("batch_put_from", "batch_get_into", "batch_remove"):
        setattr(MissingMethods, _name, lambda *args: None)


class ScopeAsText(WrappedStore):
    pool_scope = "shared"  # type: ignore[assignment]  # the enum's value, not the enum


class NoHitSource(WrappedStore):
    hit_source = None  # type: ignore[assignment]


NOT_A_CLASS = WrappedStore.opened

_HERE = "tests.unit.test_store_registry"
_FIX = "an installed module and a class in it implementing layerkv.store.base.StoreBackend"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "tests.no_such_module:Store",
            "backend='tests.no_such_module:Store': module 'tests.no_such_module' does not import (No module named "
            "'tests.no_such_module'); fix: install it or put it on the PYTHONPATH of every engine process, or use "
            "'embedded', 'mooncake'",
        ),
        (
            f"{_HERE}:NoSuchClass",
            f"backend='{_HERE}:NoSuchClass': module '{_HERE}' has no attribute 'NoSuchClass'; fix: name {_FIX}",
        ),
        (
            f"{_HERE}:NOT_A_CLASS",
            f"backend='{_HERE}:NOT_A_CLASS': module '{_HERE}' has a list, not a class, as 'NOT_A_CLASS'; "
            f"fix: name {_FIX}",
        ),
        (
            f"{_HERE}:MissingMethods",
            f"backend='{_HERE}:MissingMethods': class MissingMethods does not implement the store backend contract "
            f"(layerkv.store.base.StoreBackend): no batch_put_from, batch_get_into, batch_remove; fix: add them, "
            f"or name {_FIX}",
        ),
        (
            f"{_HERE}:ScopeAsText",
            f"backend='{_HERE}:ScopeAsText': ScopeAsText.pool_scope='shared' must be one of PoolScope.PROCESS, "
            "PoolScope.SHARED (layerkv.store.base); fix: set it as a class attribute",
        ),
        (
            f"{_HERE}:NoHitSource",
            f"backend='{_HERE}:NoHitSource': NoHitSource.hit_source=None must be one of HitSource.HOST, "
            "HitSource.P2P, HitSource.DISK, HitSource.EXTERNAL_UNSPECIFIED (layerkv.store.base); fix: set it as a "
            "class attribute",
        ),
    ],
)
def test_a_backend_that_does_not_resolve_is_a_config_error_at_open(spec: str, message: str) -> None:
    config = LayerKVConfig.from_dict({"backend": spec}, env={})  # the form is right: checked when opened
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_store(config)
    with pytest.raises(ConfigError, match=re.escape(message)):  # not cached: asked again, refused again
        backend_class(spec)
