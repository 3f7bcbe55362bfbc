"""Fixtures of the oracle tests. `backend` is the store of one test: embedded by default,
parametrised indirectly (`@BOTH_BACKENDS`) to also run on the real Mooncake master. `make_oracle`
builds `Oracle`s over it and, at teardown, asserts nothing is left in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.harness import Backend, EmbeddedBackend, MooncakeBackend, Oracle

BOTH_BACKENDS = pytest.mark.parametrize("backend", ["embedded", "mooncake"], indirect=True)


@pytest.fixture(scope="session")
def mooncake_rank_clients(mooncake_master: Any, mooncake_store: Any) -> Iterator[Callable[[int], Any]]:
    """rank -> a Mooncake client: rank 0 the shared session client, others clients without a
    segment of their own (made once per run; closing a client takes 1-2 s)."""
    from tests.mooncake_master import connect_store

    clients: dict[int, Any] = {0: mooncake_store}

    def client(rank: int) -> Any:
        if rank not in clients:
            clients[rank] = connect_store(mooncake_master, 0)
        return clients[rank]

    yield client
    for rank, store in clients.items():
        if rank:
            store.close()


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name = getattr(request, "param", "embedded")
    if name == "embedded":
        yield EmbeddedBackend()
    elif name == "mooncake":
        yield MooncakeBackend(request.getfixturevalue("mooncake_rank_clients"))
    else:
        raise AssertionError(f"no e2e backend {name!r}")


@pytest.fixture
def make_oracle(backend: Backend) -> Iterator[Callable[..., Oracle]]:
    made: list[Oracle] = []

    def make(**kwargs: Any) -> Oracle:
        oracle = Oracle(backend, **kwargs)
        made.append(oracle)
        return oracle

    yield make
    errors = []
    for oracle in made:
        try:
            oracle.check_and_close()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, "; ".join(errors)
