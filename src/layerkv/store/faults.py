"""FaultyStore: a wrapper around any store that injects failures from rules added at runtime
(fail keys, malformed answers, exceptions, latency, lease expiry; the rules themselves:
store/fault_rules.py) and logs every call it sees. For tests, chaos runs and demos; any side,
any thread: rules and the log are guarded by one lock, the inner store is called outside it.
Sits under CheckedStore, which passes `layer_idx`.

    f = FaultyStore(backend); f.fail(GET_RANGES, key, layer_idx=2, times=1)
    store = CheckedStore(f, max_batch_keys=64)     # the worker's view
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from layerkv.store.base import STORE_CALLS, Code, KVStore, ObjectKey, Placement
from layerkv.store.fault_rules import Fault, FaultKind, FaultRules, KeyMatch, injected_codes, merged_answer

ALL_METHODS = tuple(STORE_CALLS)  # every batch call of the protocol
(IS_EXIST, PUT_START, PUT_RANGES, PUT_END, PUT_REVOKE, GET_START, GET_RANGES, GET_END, PUT_FROM, GET_INTO, REMOVE) = (
    ALL_METHODS
)


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call as the wrapper saw it; `enter_seq < exit_seq` order calls across threads."""

    method: str
    keys: tuple[ObjectKey, ...]
    layer_idx: int | None
    enter_seq: int
    exit_seq: int
    result: object  # what the caller got (None if it raised)
    thread: str
    fired: tuple[str, ...] = field(default=())  # names of the rules that fired
    num_ranges: int = 0  # range calls: ranges of all keys
    max_range_nbytes: int = 0  # range calls: the largest single range


class FaultyStore:
    """Implements `KVStore` over `inner`; with no rules it forwards every call unchanged."""

    accepts_layer_idx = True  # CheckedStore passes layer_idx= to range calls and commits

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self._inner_layer = getattr(inner, "accepts_layer_idx", False) is True
        self._lock = threading.Lock()
        self._rules = FaultRules()  # guarded by _lock
        self._calls: list[CallRecord] = []  # guarded by _lock
        self._seq = itertools.count()  # next() is atomic under the GIL; used under _lock anyway
        self._released = threading.Event()

    # ---- rules -------------------------------------------------------------------------------
    def add(self, rule: Fault) -> Fault:
        """Arm `rule` (FaultRules.add: a uniquely named copy, returned)."""
        with self._lock:
            return self._rules.add(rule)

    def fail(
        self,
        methods: str | Sequence[str],
        keys: KeyMatch = None,
        *,
        code: int = int(Code.TRANSFER_FAIL),
        layer_idx: int | None = None,
        times: int | None = None,
    ) -> Fault:
        """Matching keys of matching calls answer `code`; the inner store never sees them."""
        return self.add(Fault.of(FaultKind.FAIL, methods, keys, layer_idx, code=int(code), times=times))

    def expire_lease(self, keys: KeyMatch = None, *, layer_idx: int | None = None, times: int | None = None) -> Fault:
        """Range reads of matching keys answer -707 and their get session is dropped."""
        return self.add(
            Fault.of(
                FaultKind.EXPIRE,
                GET_RANGES,
                keys,
                layer_idx,
                code=int(Code.LEASE_EXPIRED),
                times=times,
                name="expire lease",
            )
        )

    def malformed(
        self,
        methods: str | Sequence[str],
        result: object,
        keys: KeyMatch = None,
        *,
        layer_idx: int | None = None,
        forward: bool = False,
        times: int | None = None,
    ) -> Fault:
        """Matching calls answer `result` instead of one int per key."""
        return self.add(
            Fault.of(FaultKind.MALFORMED, methods, keys, layer_idx, result=result, forward=forward, times=times)
        )

    def raise_in(
        self,
        methods: str | Sequence[str],
        exc: BaseException | None = None,
        keys: KeyMatch = None,
        *,
        layer_idx: int | None = None,
        forward: bool = False,
        times: int | None = None,
    ) -> Fault:
        """Matching calls raise `exc` (default: RuntimeError naming the call)."""
        return self.add(Fault.of(FaultKind.RAISE, methods, keys, layer_idx, exc=exc, forward=forward, times=times))

    def delay(
        self,
        methods: str | Sequence[str],
        delay_s: float,
        keys: KeyMatch = None,
        *,
        layer_idx: int | None = None,
        times: int | None = None,
        after: Fault | None = None,
    ) -> Fault:
        """Matching calls wait `delay_s` before running (`release()` ends every wait at once);
        with `after`, they wait only until a call that rule fires on has entered (an order
        between threads that no machine load can swap), `delay_s` bounding the wait."""
        return self.add(Fault.of(FaultKind.DELAY, methods, keys, layer_idx, delay_s=delay_s, times=times, after=after))

    def then(
        self,
        methods: str | Sequence[str],
        action: Callable[[list[ObjectKey], tuple[Sequence[Any], ...]], None],
        keys: KeyMatch = None,
        *,
        layer_idx: int | None = None,
        times: int | None = None,
    ) -> Fault:
        """After a matching call returned from the inner store and before its caller sees the
        answer, run `action(keys, per_key args)` (what another process does at that moment)."""
        return self.add(Fault.of(FaultKind.THEN, methods, keys, layer_idx, times=times, action=action))

    def remove(self, rule: Fault) -> None:
        with self._lock:
            self._rules.remove(rule)

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def release(self) -> None:
        """End every current and future delay now (teardown of a stall test)."""
        self._released.set()

    def armed(self, rule: Fault) -> bool:
        """`rule` can still fire (a one-shot rule stops being armed when its call enters, before
        a delay it adds has passed)."""
        with self._lock:
            return rule in self._rules

    def fired(self, rule: Fault) -> int:
        """How many completed calls `rule` fired on so far."""
        with self._lock:
            return sum(1 for c in self._calls if rule.name in c.fired)

    # ---- call log ----------------------------------------------------------------------------
    def calls(self, method: str | None = None, key: ObjectKey | None = None) -> list[CallRecord]:
        """Completed calls, in exit order, optionally only of `method` / containing `key`."""
        with self._lock:
            return [c for c in self._calls if (method is None or c.method == method) and (key is None or key in c.keys)]

    def keys_sent(self, method: str) -> list[ObjectKey]:
        """Every key of every completed `method` call (repeats kept)."""
        return [k for c in self.calls(method) for k in c.keys]

    def clear_calls(self) -> None:
        with self._lock:
            self._calls.clear()

    # ---- KVStore -----------------------------------------------------------------------------
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self.inner.register_buffer(ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> None:
        self.inner.unregister_buffer(ptr)

    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._call(IS_EXIST, keys)  # type: ignore[return-value]

    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        return self._call(PUT_START, keys, (sizes,), (placement,))  # type: ignore[return-value]

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
        layer_idx: int | None = None,
    ) -> list[int]:
        answer = self._call(PUT_RANGES, keys, (ptrs, sizes, dst_offsets), layer_idx=layer_idx)
        return answer  # type: ignore[return-value]

    def batch_put_session_end(self, keys: Sequence[ObjectKey], layer_idx: int | None = None) -> list[int]:
        return self._call(PUT_END, keys, layer_idx=layer_idx)  # type: ignore[return-value]

    def batch_put_session_revoke(self, keys: Sequence[ObjectKey], layer_idx: int | None = None) -> list[int]:
        return self._call(PUT_REVOKE, keys, layer_idx=layer_idx)  # type: ignore[return-value]

    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._call(GET_START, keys)  # type: ignore[return-value]

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
        layer_idx: int | None = None,
    ) -> list[int]:
        answer = self._call(GET_RANGES, keys, (ptrs, sizes, src_offsets), layer_idx=layer_idx)
        return answer  # type: ignore[return-value]

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int:
        return self._call(GET_END, keys)  # type: ignore[return-value]

    def batch_put_from(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        return self._call(PUT_FROM, keys, (ptrs, sizes), (placement,))  # type: ignore[return-value]

    def batch_get_into(self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._call(GET_INTO, keys, (ptrs, sizes))  # type: ignore[return-value]

    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]:
        return self._call(REMOVE, keys)  # type: ignore[return-value]

    def close(self) -> None:
        self.release()
        self.inner.close()

    # ---- the one dispatch --------------------------------------------------------------------
    def _call(
        self,
        method: str,
        keys: Sequence[ObjectKey],
        per_key: tuple[Sequence[Any], ...] = (),
        extra: tuple[Any, ...] = (),
        layer_idx: int | None = None,
    ) -> object:
        keys = list(keys)
        with self._lock:
            enter_seq = next(self._seq)
            rules = self._rules.take(method, keys, layer_idx)
        fired = tuple(rule.name for rule in rules)
        sizes = [int(n) for row in per_key[1] for n in row] if method in (PUT_RANGES, GET_RANGES) else []
        result: object = None
        try:
            result = self._apply(rules, method, keys, per_key, extra, layer_idx)
            return result
        finally:
            with self._lock:
                self._calls.append(
                    CallRecord(
                        method,
                        tuple(keys),
                        layer_idx,
                        enter_seq,
                        next(self._seq),
                        result,
                        threading.current_thread().name,
                        fired,
                        len(sizes),
                        max(sizes, default=0),
                    )
                )

    def _apply(
        self,
        rules: list[Fault],
        method: str,
        keys: list[ObjectKey],
        per_key: tuple[Sequence[Any], ...],
        extra: tuple[Any, ...],
        layer_idx: int | None,
    ) -> object:
        for rule in rules:
            if rule.kind is FaultKind.DELAY and rule.after is not None:
                _first_set(rule.after.entered, self._released, rule.delay_s)
            elif rule.kind is FaultKind.DELAY:
                self._released.wait(rule.delay_s)
        whole = next((r for r in rules if r.kind in (FaultKind.MALFORMED, FaultKind.RAISE)), None)
        if whole is not None and not whole.forward:
            return whole.whole_call_answer(method, keys)
        codes = injected_codes(rules, keys)  # key position -> injected code
        expired = [keys[i] for i, code in codes.items() if code == int(Code.LEASE_EXPIRED) and method == GET_RANGES]
        if expired:
            self.inner.batch_get_session_end(expired)  # Mooncake drops the session on -707
        passed = [i for i in range(len(keys)) if i not in codes]
        inner_result = self._forward(method, keys, passed, per_key, extra, layer_idx) if passed else None
        for rule in rules:
            if rule.kind is FaultKind.THEN and rule.action is not None:
                rule.action(keys, per_key)
        if whole is not None:
            return whole.whole_call_answer(method, keys)
        if method == GET_END:
            return inner_result if inner_result is not None else (next(iter(codes.values()), 0) if codes else 0)
        return merged_answer(codes, passed, inner_result, len(keys))

    def _forward(
        self,
        method: str,
        keys: list[ObjectKey],
        rows: list[int],
        per_key: tuple[Sequence[Any], ...],
        extra: tuple[Any, ...],
        layer_idx: int | None,
    ) -> object:
        sub_keys = [keys[i] for i in rows] if len(rows) != len(keys) else keys
        sub_args = [[arg[i] for i in rows] for arg in per_key] if len(rows) != len(keys) else list(per_key)
        kwargs = {"layer_idx": layer_idx} if self._inner_layer and layer_idx is not None else {}
        return getattr(self.inner, method)(sub_keys, *sub_args, *extra, **kwargs)


def _first_set(event: threading.Event, released: threading.Event, timeout_s: float) -> None:
    """Wait until `event` or `released` is set, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (event.is_set() or released.is_set()):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        event.wait(min(left, 0.01))
