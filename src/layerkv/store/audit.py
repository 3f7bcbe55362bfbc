"""Range debug audit (LAYERKV_RANGE_DEBUG=1): one JSON line per range call, commit and
whole-object call, written through a logger to `range_debug_path` or stderr. Any side, any
thread (logging's handler locks serialise lines). A failure to log never reaches the caller.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig

log = logging.getLogger(__name__)
_FIRST = 8  # offsets / results shown per line; the counts are always complete
_ids = itertools.count()


class RangeAudit:
    """Writes audit lines to its own non-propagating logger `layerkv.range_audit.<n>`."""

    def __init__(self, path: str | None = None, handler: logging.Handler | None = None) -> None:
        self.logger = logging.getLogger(f"layerkv.range_audit.{next(_ids)}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.path = path
        self.handler = handler or _open_handler(path)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)
        self.num_failures = 0  # lines that could not be written (racy count; diagnostics only)

    @classmethod
    def from_config(cls, config: LayerKVConfig) -> RangeAudit | None:
        """An audit when `config.range_debug` is on, else None."""
        return cls(config.range_debug_path) if config.range_debug else None

    def record(
        self,
        call: str,
        direction: str,
        keys: Sequence[str],
        results: Sequence[int],
        *,
        layer_idx: int | None = None,
        nbytes: int = 0,
        offsets: Sequence[Sequence[int]] | Sequence[int] | None = None,
    ) -> None:
        """Write one line. Never raises: an error is counted and reported once at WARNING."""
        try:
            flat = _flatten(offsets) if offsets is not None else []
            line = {
                "ts": round(time.time(), 6),
                "call": call,
                "direction": direction,
                "layer": layer_idx,
                "num_keys": len(keys),
                "first_keys": list(keys[:2]),
                "bytes": nbytes,
                "offsets": {"first": flat[:_FIRST], "count": len(flat)},
                "results": {
                    "first": [int(r) for r in results[:_FIRST]],
                    "num_failed": sum(1 for r in results if r < 0),
                },
            }
            self.logger.info(json.dumps(line, separators=(",", ":")))
        except Exception as exc:  # a broken audit must never affect a transfer
            self.num_failures += 1
            if self.num_failures == 1:
                log.warning("layerkv: range audit failed to write a line (%r); continuing without it", exc)

    def note(self, event: str, **fields: object) -> None:
        """One line for a decision (e.g. a step's transfer plan). Never raises."""
        try:
            self.logger.info(
                json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, separators=(",", ":"), default=str)
            )
        except Exception:  # noqa: BLE001 - a broken audit must never affect a transfer
            self.num_failures += 1

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        try:
            self.handler.close()
        except Exception as exc:  # closing a broken handler must not fail shutdown
            log.warning("layerkv: closing the range audit handler failed: %r", exc)


def _open_handler(path: str | None) -> logging.Handler:
    if path is None:
        return logging.StreamHandler(sys.stderr)
    try:
        return logging.FileHandler(path, encoding="utf-8")
    except OSError as exc:
        log.warning("layerkv: range_debug_path=%r cannot be opened (%s); auditing to stderr", path, exc)
        return logging.StreamHandler(sys.stderr)


def _flatten(offsets: Sequence[Sequence[int]] | Sequence[int]) -> list[int]:
    out: list[int] = []
    for item in offsets:
        if isinstance(item, (list, tuple)):
            out.extend(int(x) for x in item)
        else:
            out.append(int(item))  # type: ignore[arg-type]
    return out
