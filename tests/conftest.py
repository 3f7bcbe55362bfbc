"""Shared pytest fixtures: the real mooncake_master (tests/mooncake_master.py) and the one store
backend fixture of every test (tests/backends.py) are registered here."""

from __future__ import annotations

import logging

pytest_plugins = ["tests.mooncake_master", "tests.backends"]

logging.getLogger("layerkv").setLevel(logging.INFO)
