"""Fixtures of the proxy tests: two fake prefill and two fake decode servers in this process,
each test starting from modes OK and nothing received."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from layerkv.bench.proxy.fake_vllm import FakeFleet, FakeServer, Mode

NAMES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def _fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet([FakeServer(name, name.split("-")[0]) for name in NAMES]).start()
    yield fleet
    fleet.close()


@pytest.fixture
def fleet(_fleet: FakeFleet) -> FakeFleet:
    for server in _fleet.servers.values():
        server.mode = Mode.OK
        with server._arrived:
            server.received.clear()
    return _fleet


def urls(fleet: FakeFleet, role: str) -> list[str]:
    return [s.url for s in fleet.servers.values() if s.role == role]
