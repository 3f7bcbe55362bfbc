"""The cluster tier: the five-host pool of tests/cluster/pool.py (a master host, two storage
hosts, a producer and a consumer engine host), one per test module. Without root, iproute2 or
scripts/isolated.sh's namespace the tier fails, saying why; it is never skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.pool import Pool, started_pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with started_pool(tmp_path_factory.mktemp("cluster")) as made:
        yield made
