"""The stores a bench suite runs against: the embedded store, and Mooncake with the segment in
this process ("mooncake-local": a client mounting its own segment) or in another process
("mooncake-remote": a `layerkv master` subprocess holds the segment, our client mounts none).
Every master binds 127.0.0.1 and is stopped on exit. Driver thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from layerkv.store.base import KVStore
from layerkv.store.embedded import EmbeddedStore

log = logging.getLogger(__name__)
MiB = 1 << 20
SEGMENT_BYTES = 512 * MiB
_HOLDER_START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Backend:
    """A named raw store (the suite wraps it in CheckedStore as layerkv does)."""

    name: str
    store: KVStore
    note: str


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401

        from layerkv.store.mooncake_master import find_master_binary

        find_master_binary()
    except Exception:  # noqa: BLE001 - any import / lookup problem means "skip Mooncake"
        return False
    return True


@contextlib.contextmanager
def open_backends(
    with_mooncake: bool, segment_bytes: int = SEGMENT_BYTES, *, remote: bool = True
) -> Iterator[list[Backend]]:
    """Yield the embedded store plus (if asked and installed) both Mooncake setups; closes
    clients and stops masters / the holder process on exit."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # loopback only
    with contextlib.ExitStack() as stack:
        embedded = EmbeddedStore(capacity_bytes=2 * segment_bytes)
        stack.callback(embedded.close)
        backends = [Backend("embedded", embedded, "in-process store (memcpy under one lock)")]
        if with_mooncake and mooncake_available():
            backends.append(stack.enter_context(_mooncake_local(segment_bytes)))
            if remote:
                backends.append(stack.enter_context(_mooncake_remote(segment_bytes)))
        yield backends


@contextlib.contextmanager
def _mooncake_local(segment_bytes: int) -> Iterator[Backend]:
    from layerkv.store.mooncake import MooncakeStore
    from layerkv.store.mooncake_master import start_master

    master = start_master()
    try:
        store = MooncakeStore.from_mooncake_config(master.config(global_segment_size=segment_bytes))
        try:
            yield Backend("mooncake-local", store, "Mooncake over TCP loopback; segment mounted by this client")
        finally:
            store.close()
    finally:
        master.stop()


@contextlib.contextmanager
def _mooncake_remote(segment_bytes: int) -> Iterator[Backend]:
    """`layerkv master` in a child process (master + segment holder); our client mounts 0 bytes."""
    from layerkv.store.local_master import LocalMaster
    from layerkv.store.mooncake import MooncakeStore

    with LocalMaster(str(segment_bytes), startup_timeout_s=_HOLDER_START_TIMEOUT_S) as deployment:
        store = MooncakeStore.from_mooncake_config(deployment.client_config)
        try:
            yield Backend(
                "mooncake-remote", store, "Mooncake over TCP loopback; segment held by a `layerkv master` process"
            )
        finally:
            store.close()
        deployment.check_alive()  # numbers measured against a dead holder are not results
