"""The tests' side of layerkv.bench.cluster.pool: the five hosts of the cluster tier, the pool
started for a test module (a failure, never a skip, where no cluster can be made: CI runs as
root), and the reference engine of tests/cluster/engine_process.py started on a host. Used by
the cluster tier (tests/cluster) and the real-engine tier's cluster pair. Test thread."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest

from layerkv.bench.cluster.pool import ClusterPool, HostProcess, cluster_problems
from layerkv.bench.cluster.pool import started_pool as _started_pool

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("master", "store1", "store2", "producer", "consumer")
Proc = HostProcess  # the fault tests' name for it


class Pool(ClusterPool):
    def engine(self, host: str, job: dict[str, Any], name: str) -> HostProcess:
        """The reference engine of tests/cluster/engine_process.py on `host`."""
        return self.run_module(host, "tests.cluster.engine_process", job, name)

    def report(self, proc: HostProcess, timeout_s: float = 180.0) -> dict[str, Any]:
        """The engine's "@@" report line."""
        return dict(json.loads("{" + proc.line("@@{", timeout_s)))


@contextmanager
def started_pool(
    tmp: Path, hosts: Sequence[str] = HOSTS, storage: Sequence[str] = ("store1", "store2")
) -> Iterator[Pool]:
    problems = cluster_problems()
    if problems:
        pytest.fail("the cluster tier cannot run: " + "; ".join(problems), pytrace=False)
    with _started_pool(tmp, hosts, storage, pythonpath=[REPO_ROOT], pool_type=Pool) as made:
        yield cast(Pool, made)
