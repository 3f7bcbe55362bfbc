"""Pytest plugin: a real `mooncake_master` on loopback and Mooncake clients for tests.

Registered from tests/conftest.py (`pytest_plugins`). Fixtures: `mooncake_master` (session, one
master for the run), `mooncake_harness` (per test: clients on that master, extra masters, all
closed at teardown). Without mooncake installed the tests skip locally but FAIL when CI=true.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from layerkv.errors import StoreError
from layerkv.store.mooncake_master import MIN_SEGMENT_BYTES, MasterProcess, find_master_binary, start_master

if TYPE_CHECKING:
    from layerkv.store.base import Placement
    from layerkv.store.mooncake import MooncakeStore

__all__ = [
    "start_master",
    "MasterProcess",
    "connect_store",
    "MooncakeHarness",
    "require_mooncake",
    "MOONCAKE_PROBLEM_LINE",
]

SHARED_SEGMENT_BYTES = 64 << 20
# A Mooncake (glog) ERROR / WARNING / FATAL line as it appears on a terminal: `E1130 19:20:19.914211 ...`
MOONCAKE_PROBLEM_LINE = re.compile(r"^[EWF]\d{4} \d\d:\d\d:\d\d\.\d+ ", re.MULTILINE)

# Transfer-engine traffic on loopback only, for every client this process creates.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def _missing_reason() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)"
    try:
        find_master_binary()
    except StoreError as exc:
        return str(exc)
    return None


def require_mooncake() -> None:
    """Skip when Mooncake is missing, except in CI (CI=true), where that is a failure."""
    reason = _missing_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the Mooncake tests: {reason}", pytrace=False)
    pytest.skip(reason)


def connect_store(
    master: MasterProcess,
    segment_bytes: int = MIN_SEGMENT_BYTES,
    *,
    placement: Placement | None = None,
    client_cls: type | None = None,
) -> MooncakeStore:
    """A MooncakeStore client of `master` whose global segment is `segment_bytes` (0: none)."""
    from layerkv.store.mooncake import MooncakeStore

    return MooncakeStore.from_mooncake_config(
        master.config(global_segment_size=segment_bytes), placement=placement, client_cls=client_cls
    )


class MooncakeHarness:
    """What the conformance suite needs from a backend: `.store`, `.new_client()` (a second
    independent client on the same master), `.make_store(capacity_bytes, lease_ttl_s)` (a fresh
    master with that lease ttl and one client whose segment is the capacity). `close()` stops
    everything it created (not the shared master)."""

    name = "mooncake"

    def __init__(
        self,
        master: MasterProcess,
        segment_bytes: int = SHARED_SEGMENT_BYTES,
        shared_store: MooncakeStore | None = None,
    ) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self._store = shared_store  # not closed by this harness
        self._clients: list[MooncakeStore] = []
        self._masters: list[MasterProcess] = []

    @property
    def store(self) -> MooncakeStore:
        if self._store is None:
            self._store = self.new_client(self.segment_bytes)
        return self._store

    def new_client(self, segment_bytes: int | None = None, **kwargs: Any) -> MooncakeStore:
        client = connect_store(self.master, self.segment_bytes if segment_bytes is None else segment_bytes, **kwargs)
        self._clients.append(client)
        return client

    def new_master(self, lease_ttl_ms: int | None = None) -> MasterProcess:
        master = start_master(lease_ttl_ms)
        self._masters.append(master)
        return master

    def make_store(self, capacity_bytes: int, lease_ttl_s: float) -> MooncakeStore:
        master = self.new_master(max(1, round(lease_ttl_s * 1000)))
        client = connect_store(master, capacity_bytes)
        self._clients.append(client)
        return client

    def close(self) -> None:
        errors: list[str] = []
        for client in reversed(self._clients):
            try:
                client.close()
            except StoreError as exc:
                errors.append(str(exc))
        for master in self._masters:
            master.stop()
        self._clients.clear()
        self._masters.clear()
        if errors:
            raise StoreError("closing Mooncake test clients failed: " + "; ".join(errors))


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MasterProcess]:
    """One real mooncake_master on loopback for the whole run (never restart it in a test)."""
    require_mooncake()
    master = start_master()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_store(mooncake_master: MasterProcess) -> Iterator[MooncakeStore]:
    """One client of the session master holding a 64 MiB segment, shared by every test (a
    Mooncake client takes 1-2 s to close). Tests use unique keys and remove what they write."""
    store = connect_store(mooncake_master, SHARED_SEGMENT_BYTES)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def mooncake_harness(mooncake_master: MasterProcess, mooncake_store: MooncakeStore) -> Iterator[MooncakeHarness]:
    """`.store` is the shared session client; `.new_client()` / `.make_store()` are closed at teardown."""
    harness = MooncakeHarness(mooncake_master, shared_store=mooncake_store)
    try:
        yield harness
    finally:
        harness.close()
