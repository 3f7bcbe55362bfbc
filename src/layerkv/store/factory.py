"""Opens the store a config names: `config.backend`'s class (store/registry.py: a built-in name or
an out-of-tree "module:Class") makes each client. Any side, any thread; each `open_store` call
gets its own client handle, closed by its caller. An in-process backend (the embedded store)
shares one store per process and settings (store/process_stores.py), so the scheduler side and
every worker side of one process see the same objects. A backend that does not resolve raises
ConfigError naming `backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layerkv.store.registry import backend_class

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig
    from layerkv.store.base import KVStore
    from layerkv.store.checked import CheckedStore


def open_store(config: LayerKVConfig) -> KVStore:
    """A new client of the store `config.backend` names (its class's `from_config`). Embedded:
    a handle on the process-wide store for these settings (the objects live until
    `process_stores.close_shared_stores`). Mooncake: a new `MooncakeStore` client."""
    return backend_class(config.backend).from_config(config)


def pool_identity(config: LayerKVConfig) -> str:
    """Which pool `config` writes to and reads from: the backend, where it is (its class's
    `pool_address`: the Mooncake master address as configured; the embedded store is this
    process's), and the tenant its objects are kept under. Holds no secret; may name an address
    (digest it before showing it to clients). Mooncake reads its JSON config when the master is
    not given otherwise."""
    where = backend_class(config.backend).pool_address(config)
    return f"{config.backend}|{where}|{config.tenant}|{config.mooncake_tenant_id or config.tenant}"


def open_checked_store(config: LayerKVConfig) -> CheckedStore:
    """`open_store` wrapped in the one place that splits batches by `max_transfer_blocks`,
    validates every result and writes the range audit (LAYERKV_RANGE_DEBUG=1)."""
    from layerkv.store.audit import RangeAudit
    from layerkv.store.checked import CheckedStore

    return CheckedStore(
        open_store(config),
        max_batch_keys=config.max_transfer_blocks,
        audit=RangeAudit.from_config(config),
        retry_interval_s=config.store_retry_interval_s,
        call_timeout_s=config.store_call_timeout_s,
    )
