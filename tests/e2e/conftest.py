"""Fixtures of the oracle tests. `backend` (tests/backends.py) is the store of one test: embedded
by default, parametrised indirectly (`@BOTH_BACKENDS`) to also run on the real Mooncake master. `make_oracle`
builds `Oracle`s over it and, at teardown, asserts nothing is left in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.backends import Backend
from tests.e2e.harness import Oracle


@pytest.fixture
def make_oracle(backend: Backend) -> Iterator[Callable[..., Oracle]]:
    made: list[Oracle] = []

    def make(**kwargs: Any) -> Oracle:
        oracle = Oracle(backend, **kwargs)
        made.append(oracle)
        return oracle

    yield make
    errors = []
    for oracle in made:  # one store may serve several oracles: it closes after the last
        try:
            oracle.check_and_close(close_backend=False)
        except AssertionError as exc:
            errors.append(str(exc))
    backend.close(sorted({k for oracle in made for k in oracle.written_keys()}))
    assert not errors, "; ".join(errors)
