"""Fixtures of the connector tests: every test that takes the `backend` fixture runs on the
embedded store and on the real Mooncake master; `make_rig` builds rigs on it and, after the test,
drains them and asserts: no session left, no PROCESSING object of ours, transfer threads joined."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from layerkv.store.faults import PUT_START
from tests.backends import BACKENDS, Backend
from tests.connector.rig import Rig


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Both backends for every connector test, unless the test parametrises `backend` itself."""
    own = any("backend" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize"))
    if "backend" in metafunc.fixturenames and not own:
        metafunc.parametrize("backend", BACKENDS, indirect=True)


@pytest.fixture
def make_rig(backend: Backend) -> Iterator[Any]:
    """`make_rig(**kwargs)` -> Rig on this test's backend. Teardown: release stalls, drain every
    rig (finish its requests through the hooks), then check for leaks and shut down."""
    rigs: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        rig = Rig(backend, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    problems: list[str] = []
    for rig in rigs:
        for faulty in (rig.sched_faults, *rig.faults):
            faulty.clear_rules()
            faulty.release()
        rig.drain()
        for rank, worker in enumerate(rig.workers):
            if not worker.is_idle(5.0):
                problems.append(f"rank {rank} sessions left: {worker.open_sessions()}")
        started = sorted({k for f in rig.faults for k in f.keys_sent(PUT_START)})
        stuck = backend.processing_keys(started)
        if stuck:
            problems.append(f"PROCESSING objects left: {stuck[:4]} ({len(stuck)})")
        rig.shutdown()
        alive = [name for w in rig.workers for name in w.threads_alive()]
        if alive:
            problems.append(f"threads still alive after shutdown: {alive}")
    assert not problems, "; ".join(problems)
