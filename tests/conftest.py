"""Shared pytest fixtures. Backend fixtures (embedded, real mooncake_master) live in
tests/conftest_backends.py and are registered here."""

from __future__ import annotations

import logging

pytest_plugins = ["tests.mooncake_master"]  # real mooncake_master fixtures

logging.getLogger("layerkv").setLevel(logging.INFO)
