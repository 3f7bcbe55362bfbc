"""native_log: which Mooncake log level a command asks for, and the start-up capture on fd 2
(glog lines kept, every other line re-emitted), with real writes to file descriptor 2."""

from __future__ import annotations

import os

import pytest

from layerkv.errors import ConfigError
from layerkv.store import native_log

GLOG_ERROR = (
    "E1130 19:20:19.914211  8584 transfer_metadata_plugin.cpp:292] GET http://x http=404 body: metadata not found"
)
GLOG_INFO = "I1130 19:20:19.913331  8584 transfer_engine_impl.cpp:1046] Metrics reporting is disabled"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native_log.ENV, raising=False)
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)


def test_commands_default_to_quiet_and_ask_mooncake_for_errors_only() -> None:
    assert native_log.configure(None) == "quiet"
    assert os.environ[native_log.ENV] == "quiet" and os.environ["MC_LOG_LEVEL"] == "ERROR"
    assert native_log.is_quiet()


def test_flag_beats_env_and_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_log.ENV, "warning")
    assert native_log.configure(None) == "warning" and os.environ["MC_LOG_LEVEL"] == "WARNING"
    assert native_log.configure("info") == "info" and os.environ["MC_LOG_LEVEL"] == "INFO"
    assert not native_log.is_quiet()


def test_a_users_own_mc_log_level_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_LOG_LEVEL", "TRACE")
    assert native_log.configure(None) == "info"
    assert os.environ["MC_LOG_LEVEL"] == "TRACE" and not native_log.is_quiet()


def test_an_unknown_level_names_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_log.ENV, "loud")
    with pytest.raises(ConfigError, match=r"LAYERKV_MOONCAKE_LOG='loud' must be one of quiet, error, warning, info"):
        native_log.configure(None)


def test_quiet_capture_keeps_glog_lines_and_reemits_the_rest(capfd: pytest.CaptureFixture[str]) -> None:
    native_log.configure("quiet")
    with native_log.capture_startup() as captured:
        os.write(2, f"WARNING: Logging before InitGoogleLogging() is written to STDERR\n{GLOG_INFO}\n".encode())
        os.write(2, f"{GLOG_ERROR}\nlayerkv: an own line\n".encode())
    assert capfd.readouterr().err == "layerkv: an own line\n"
    assert captured.lines[1:] == [GLOG_INFO, GLOG_ERROR]
    assert captured.problems() == GLOG_ERROR
    os.write(2, b"after the capture\n")  # fd 2 is back
    assert capfd.readouterr().err == "after the capture\n"


def test_capture_is_a_no_op_unless_quiet(capfd: pytest.CaptureFixture[str]) -> None:
    native_log.configure("error")
    with native_log.capture_startup() as captured:
        os.write(2, f"{GLOG_ERROR}\n".encode())
    assert capfd.readouterr().err == f"{GLOG_ERROR}\n" and captured.lines == []


def test_capture_restores_fd_2_when_the_block_raises(capfd: pytest.CaptureFixture[str]) -> None:
    native_log.configure("quiet")
    with pytest.raises(RuntimeError), native_log.capture_startup() as captured:
        os.write(2, f"{GLOG_ERROR}\n".encode())
        raise RuntimeError("setup raised")
    os.write(2, b"visible\n")
    assert capfd.readouterr().err == "visible\n" and captured.lines == [GLOG_ERROR]
