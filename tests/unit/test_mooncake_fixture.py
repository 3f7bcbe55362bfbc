"""The Mooncake fixture never skips in CI: a missing Mooncake is a failure there."""

from __future__ import annotations

import pytest

import tests.mooncake_master as fixture


def test_missing_mooncake_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixture, "_missing_reason", lambda: "mooncake is not installed")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the Mooncake tests: mooncake is not installed"):
        fixture.require_mooncake()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="mooncake is not installed"):
        fixture.require_mooncake()


def test_installed_mooncake_is_found() -> None:
    reason = fixture._missing_reason()
    if reason is not None:
        fixture.require_mooncake()  # skips locally, fails in CI
    assert reason is None
