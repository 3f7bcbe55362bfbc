"""Fixtures of the chaos tier: the run's seed (LAYERKV_CHAOS_SEED, else a fresh one; printed),
the local oracle shared by every round, and `make_rig` (a Rig per round, always closed)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.engines import LocalOracle
from tests.chaos.rig import Rig
from tests.mooncake_master import require_mooncake

SEED_ENV = "LAYERKV_CHAOS_SEED"


@pytest.fixture(scope="session")
def chaos_seed(request: pytest.FixtureRequest) -> int:
    """The run's seed: $LAYERKV_CHAOS_SEED if set, else a fresh one. Printed at once (also when
    output is captured) and named in every round's failure message."""
    text = os.environ.get(SEED_ENV, "").strip()
    seed = int(text) if text else random.SystemRandom().randrange(1 << 31)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = f"chaos tier seed: {seed} (rerun this run's rounds with {SEED_ENV}={seed})"
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line)
    return seed


@pytest.fixture(scope="session")
def local_oracle() -> Iterator[LocalOracle]:
    oracle = LocalOracle()
    yield oracle
    oracle.close()


@pytest.fixture
def make_rig(
    request: pytest.FixtureRequest, chaos_seed: int, local_oracle: LocalOracle, tmp_path: Path
) -> Iterator[Callable[..., Rig]]:
    require_mooncake()
    rigs: list[Rig] = []
    name = request.node.name.removeprefix("test_")

    def make(**kwargs: Any) -> Rig:
        rig = Rig(name, chaos_seed, tmp_path, kwargs.pop("oracle", local_oracle), **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and rigs and rigs[-1].outputs:
        reporter.write_line(rigs[-1].summary())
