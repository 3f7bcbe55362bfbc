"""Gate: a store wrapper (tests only) that stops a transfer at an exact point. Armed for one
(method, layer_idx), the first matching call announces itself and blocks, before or after it
reaches the store, until the test opens the gate; the process around it keeps running (or is
SIGSTOPped by the test at that moment). Sits under FaultyStore, which passes `layer_idx`.
Any thread: the armed rule is guarded by one lock; the blocked call waits on an Event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerkv.store.base import KVStore

Announce = Callable[[dict[str, Any]], None]
SLOW_S = 0.25  # store calls at least this long are listed in `slow_calls` (diagnostics)


@dataclass(frozen=True, slots=True)
class GateRule:
    method: str
    layer_idx: int | None = None  # None: any call of `method`
    when: str = "before"  # "before": the call has not reached the store; "after": it has returned


class Gate:
    accepts_layer_idx = True  # FaultyStore passes layer_idx= to range calls and commits

    def __init__(self, inner: KVStore, announce: Announce) -> None:
        self.inner = inner
        self.name = f"gate({inner.name})"
        self._announce = announce
        self._lock = threading.Lock()
        self._rule: GateRule | None = None  # guarded by _lock
        self._opened = threading.Event()
        self.slow_calls: list[tuple[str, int | None, float]] = []  # guarded by _lock: calls of >= SLOW_S

    def arm(self, rule: GateRule) -> None:
        if rule.when not in ("before", "after"):
            raise ValueError(f"gate when={rule.when!r} must be 'before' or 'after'")
        with self._lock:
            self._rule = rule
            self._opened.clear()

    def open(self) -> None:
        """Let the blocked call (and any later one) through."""
        with self._lock:
            self._rule = None
        self._opened.set()

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.inner, method)
        if not method.startswith("batch_"):
            return target

        def call(keys: Any, *args: Any, layer_idx: int | None = None, **kwargs: Any) -> Any:
            self._maybe_block(method, layer_idx, keys, "before")
            start = time.monotonic()
            result = target(keys, *args, **kwargs)
            took_s = time.monotonic() - start
            if took_s >= SLOW_S:
                with self._lock:
                    self.slow_calls.append((method, layer_idx, round(took_s, 3)))
            self._maybe_block(method, layer_idx, keys, "after", result)
            return result

        return call

    def _maybe_block(self, method: str, layer_idx: int | None, keys: Any, when: str, result: Any = None) -> None:
        with self._lock:
            rule = self._rule
            if rule is None or rule.method != method or rule.when != when:
                return
            if rule.layer_idx is not None and rule.layer_idx != layer_idx:
                return
            self._rule = None  # fires once
        self._announce(
            {
                "event": "gated",
                "method": method,
                "layer_idx": layer_idx,
                "when": when,
                "keys": list(keys),
                "result": result if isinstance(result, (list, int)) else None,
            }
        )
        self._opened.wait(600.0)  # the test opens it, or kills the process
