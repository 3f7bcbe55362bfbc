"""Mooncake's native (glog) log on layerkv's terminals: which level Mooncake is asked for, and a
capture of the start-up chatter. Process-wide (environment and fd 2); captures are serialised
by one lock. No mooncake import.

What Mooncake 0.3.13 honours (read in its transfer-engine config and checked here): the client
library logs through glog to fd 2 of the Python process, and on its first transfer engine it sets
glog's minimum level from MC_LOG_LEVEL (INFO | WARNING | ERROR; anything else means INFO),
overriding GLOG_minloglevel. So nothing above ERROR is reachable by environment, and a healthy
client setup logs `E... transfer_metadata_plugin.cpp] GET ... http=404 metadata not found` (it
asks for its own segment before publishing it). Level `quiet` therefore means MC_LOG_LEVEL=ERROR
plus `capture_startup()` around client setup: fd 2 goes to a file while Mooncake starts; its glog
lines are kept (logged at DEBUG, and quoted in the error if setup fails), anything else written
meanwhile (layerkv's own log lines) is re-emitted on stderr.

    LAYERKV_MOONCAKE_LOG = quiet (commands' default) | error | warning | info
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

from layerkv.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "LAYERKV_MOONCAKE_LOG"
LEVELS = ("quiet", "error", "warning", "info")
_MC_LOG_LEVEL = {"quiet": "ERROR", "error": "ERROR", "warning": "WARNING", "info": "INFO"}
_GLOG_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]]*\] |WARNING: Logging before InitGoogleLogging)"
)
_GLOG_PROBLEM = re.compile(r"^[EWF]\d{4} ")  # glog WARNING / ERROR / FATAL
_CAPTURE_LOCK = threading.Lock()  # guards fd 2 while it is redirected


def configure(level: str | None = None) -> str:
    """Choose Mooncake's native log level for this process and its children; the commands call it
    before any Mooncake client starts. `level` (a command's --mooncake-log) wins, then
    $LAYERKV_MOONCAKE_LOG, then a user's own MC_LOG_LEVEL (left as set), else `quiet`.
    Sets LAYERKV_MOONCAKE_LOG and MC_LOG_LEVEL in os.environ; returns the level."""
    chosen = level or os.environ.get(ENV)
    if chosen is None and os.environ.get("MC_LOG_LEVEL"):
        own = os.environ["MC_LOG_LEVEL"].lower()
        os.environ[ENV] = own if own in LEVELS else "info"
        return os.environ[ENV]
    chosen = chosen or "quiet"
    if chosen not in LEVELS:
        raise ConfigError(f"{ENV}={chosen!r} must be one of {', '.join(LEVELS)} (quiet hides Mooncake's start-up log)")
    os.environ[ENV] = chosen
    os.environ["MC_LOG_LEVEL"] = _MC_LOG_LEVEL[chosen]
    return chosen


def is_quiet() -> bool:
    """True when $LAYERKV_MOONCAKE_LOG is `quiet` (a library user who sets nothing gets Mooncake's own log)."""
    return os.environ.get(ENV) == "quiet"


class Captured:
    """The glog lines Mooncake wrote during a capture (empty when not quiet)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def problems(self, max_lines: int = 5) -> str:
        """The last error / warning lines, `; `-joined, for an error message."""
        bad = [line for line in self.lines if _GLOG_PROBLEM.match(line)]
        return "; ".join(bad[-max_lines:])


@contextlib.contextmanager
def capture_startup() -> Iterator[Captured]:
    """While quiet: send fd 2 to a temporary file for the block (a Mooncake client setup); keep
    the glog lines, re-emit every other line on stderr. A no-op otherwise. Thread-safe (one
    capture at a time); the block should be short and must not wait for another capture."""
    captured = Captured()
    if not is_quiet():
        yield captured
        return
    with _CAPTURE_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved_fd = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            _sort_lines(sink.read().decode(errors="replace"), captured)


def _sort_lines(text: str, captured: Captured) -> None:
    others: list[str] = []
    for line in text.splitlines():
        (captured.lines if _GLOG_LINE.match(line) else others).append(line)
    if others:
        sys.stderr.write("\n".join(others) + "\n")
        sys.stderr.flush()
    for line in captured.lines:
        log.debug("mooncake: %s", line)
