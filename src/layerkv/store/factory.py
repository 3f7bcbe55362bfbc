"""Opens the store a config names. Any side, any thread: the embedded backend is shared per
process (one store per capacity/lease/timeout), so the scheduler side and every worker side of
one process see the same objects; each `open_store` call gets its own client handle.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from layerkv.store.embedded import EmbeddedStore

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig
    from layerkv.store.base import KVStore
    from layerkv.store.checked import CheckedStore

_SharedKey = tuple[int, float, float]
_lock = threading.Lock()
_shared: dict[_SharedKey, EmbeddedStore] = {}  # guarded by _lock; the root handle of each store


def open_store(config: LayerKVConfig) -> KVStore:
    """A new client of the store `config.backend` names. Embedded: a handle on the process-wide
    store for these settings (close it when done; the objects live until
    `close_shared_stores`). Mooncake: a new `MooncakeStore` (imported lazily)."""
    if config.backend == "mooncake":
        from layerkv.store.mooncake import MooncakeStore

        return MooncakeStore.from_config(config)
    key = (config.embedded_capacity_bytes, config.embedded_lease_ttl_s, config.embedded_put_timeout_s)
    with _lock:
        root = _shared.get(key)
        if root is None:
            root = _shared[key] = EmbeddedStore.from_config(config)
        return root.client()


def pool_identity(config: LayerKVConfig) -> str:
    """Which pool `config` writes to and reads from: the backend, where it is (the Mooncake master
    address as configured; the embedded store is this process's), and the tenant its objects
    are kept under. Holds no secret; may name an address (digest it before showing it to
    clients). Reads the Mooncake JSON config when the master is not given otherwise."""
    if config.backend == "mooncake":
        from layerkv.store.mooncake import master_address_of

        where = master_address_of(config)
    else:
        where = "this-process"
    return f"{config.backend}|{where}|{config.tenant}|{config.mooncake_tenant_id or config.tenant}"


def close_shared_stores() -> None:
    """Close every shared embedded store's root handle (tests). Stores whose client handles are
    all closed free their memory now; the next `open_store` starts an empty store."""
    with _lock:
        roots = list(_shared.values())
        _shared.clear()
    for root in roots:
        root.close()


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
