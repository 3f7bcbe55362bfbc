"""Fixtures of the oracle tests. `backend` (tests/backends.py) is the store of one test: embedded
by default, parametrised indirectly (`@BOTH_BACKENDS`) to also run on the real Mooncake master. `make_oracle`
builds `Oracle`s over it and, at teardown, asserts nothing is left in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.backends import Backend
from tests.e2e.harness import Oracle, oracles


@pytest.fixture
def make_oracle(backend: Backend) -> Iterator[Callable[..., Oracle]]:
    yield from oracles(backend)
