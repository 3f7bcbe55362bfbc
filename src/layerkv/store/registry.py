"""The store backends by name: `backend` (config) is a built-in name below or an out-of-tree
backend's "package.module:Class"; `backend_class` imports that class and checks it against the
backend contract (store/base.py `StoreBackend`). Any side, any thread: resolved classes are cached
per process (the cache is thread-safe); a name or class that does not resolve raises
`ConfigError` naming the `backend` key, the value and the fix, every time it is asked.

Adding a built-in backend is one line in `BUILTIN_BACKENDS` (config, the factory, the vLLM
integration and the backend-parametrised tests read it); an out-of-tree one is one config value.
Config reads this module (the names it validates `backend` against): it imports no config.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import cast

from layerkv.errors import ConfigError
from layerkv.store.base import HitSource, KVStore, PoolScope, StoreBackend

# backend name -> "module:Class" of its StoreBackend class (imported only when asked for)
BUILTIN_BACKENDS: dict[str, str] = {
    "embedded": "layerkv.store.embedded:EmbeddedStore",
    "mooncake": "layerkv.store.mooncake:MooncakeStore",
}
_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
# what a backend class must have: the KVStore methods, then the class-level contract
_METHODS = tuple(name for name, value in vars(KVStore).items() if callable(value) and not name.startswith("_"))
_CLASS_METHODS = ("from_config", "pool_address")
_SPEC_FIX = "an installed module and a class in it implementing layerkv.store.base.StoreBackend"


def is_backend(value: str) -> bool:
    """Whether `value` may name a backend: a built-in name or the form "package.module:Class"
    (whether that class imports and fits is `backend_class`'s question). Pure, no import."""
    return value in BUILTIN_BACKENDS or _SPEC.fullmatch(value) is not None


def backend_rule() -> str:
    """The `backend` rule, as config errors state it."""
    return f"one of {', '.join(BUILTIN_BACKENDS)}, or 'package.module:Class' (an out-of-tree store backend)"


@functools.cache
def backend_class(backend: str) -> type[StoreBackend]:
    """The class `backend` names (a built-in name or "module:Class"), checked against the
    contract; cached. ConfigError when the module does not import, the class is missing or not
    a class, a contract member is missing or a class property has the wrong type."""
    spec = BUILTIN_BACKENDS.get(backend, backend)
    if not _SPEC.fullmatch(spec):
        raise ConfigError(f"backend={backend!r} must be {backend_rule()}")
    module_name, class_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"backend={backend!r}: module {module_name!r} does not import ({exc}); fix: install it or put it on "
            f"the PYTHONPATH of every engine process, or use {', '.join(map(repr, BUILTIN_BACKENDS))}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        what = "has no attribute" if cls is None else f"has a {type(cls).__name__}, not a class, as"
        raise ConfigError(f"backend={backend!r}: module {module_name!r} {what} {class_name!r}; fix: name {_SPEC_FIX}")
    _check_contract(backend, cls)
    return cast("type[StoreBackend]", cls)


def _check_contract(backend: str, cls: type) -> None:
    """ConfigError unless `cls` has every KVStore method, `from_config`, `pool_address` and the
    class properties `pool_scope` (a PoolScope) and `hit_source` (a HitSource)."""
    missing = [name for name in (*_METHODS, *_CLASS_METHODS) if not callable(getattr(cls, name, None))]
    if missing:
        raise ConfigError(
            f"backend={backend!r}: class {cls.__qualname__} does not implement the store backend contract "
            f"(layerkv.store.base.StoreBackend): no {', '.join(missing)}; fix: add them, or name {_SPEC_FIX}"
        )
    for name, kind in (("pool_scope", PoolScope), ("hit_source", HitSource)):
        value = getattr(cls, name, None)
        if not isinstance(value, kind):
            choices = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
            raise ConfigError(
                f"backend={backend!r}: {cls.__qualname__}.{name}={value!r} must be one of {choices} "
                f"(layerkv.store.base); fix: set it as a class attribute"
            )
