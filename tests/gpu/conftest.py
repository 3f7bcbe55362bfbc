"""The GPU tier: the reference engine on CUDA (bf16), its KV caches on the device, layerkv's
connector over the embedded store through pinned host staging and side-stream copies. It runs
only where torch sees a CUDA device (scripts/gpu_check.sh runs it there); elsewhere it is not
collected and the run's summary says so (it is not part of the CPU pass count).

LAYERKV_GPU_DEVICE=cpu runs the same tests on this CPU (the engine on the host, the connector's
device path forced: torch copies through staging, host copies in place of streams) to check
the tests themselves; it proves nothing about CUDA.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

DEVICE = os.environ.get("LAYERKV_GPU_DEVICE", "cuda")
RUNS = DEVICE == "cpu" or torch.cuda.is_available()
NOT_RUN = "tests/gpu: not run (no CUDA device here; scripts/gpu_check.sh runs it on a GPU machine)"

collect_ignore_glob = [] if RUNS else ["test_*.py"]


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run: the connector takes its device path on host tensors (on CUDA it does anyway)."""
    import layerkv.connector.worker
    from layerkv.transfer.views import CacheViews

    if DEVICE == "cpu":
        monkeypatch.setattr(layerkv.connector.worker, "CacheViews", functools.partial(CacheViews, on_host=False))


@pytest.fixture
def make_oracle(backend: Any, device_path: None) -> Iterator[Callable[..., Any]]:
    """Oracles over the embedded store (tests/e2e/harness.py) whose engines run on DEVICE."""
    from tests.e2e.harness import oracles

    yield from oracles(backend)
