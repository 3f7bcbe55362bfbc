"""FaultyStore: a wrapper around any store that injects failures from rules added at runtime
(fail keys, malformed answers, exceptions, latency, lease expiry) and logs every call it sees.
For tests, chaos runs and demos; any side, any thread: rules and the log are guarded by one
lock, the inner store is called outside it. Sits under CheckedStore, which passes `layer_idx`.

    f = FaultyStore(backend); f.fail(GET_RANGES, key, layer_idx=2, times=1)
    store = CheckedStore(f, max_batch_keys=64)     # the worker's view
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from layerkv.store.base import STORE_CALLS, Code, KVStore, ObjectKey, Placement

ALL_METHODS = tuple(STORE_CALLS)  # every batch call of the protocol
(IS_EXIST, PUT_START, PUT_RANGES, PUT_END, PUT_REVOKE, GET_START, GET_RANGES, GET_END, PUT_FROM, GET_INTO, REMOVE) = (
    ALL_METHODS
)
_rule_ids = itertools.count(1)
KeyMatch = ObjectKey | Collection[ObjectKey] | Callable[[ObjectKey], bool] | None


class FaultKind(Enum):
    FAIL = "fail"  # matching keys get `code`; the other keys go to the inner store
    EXPIRE = "expire"  # get ranges: matching keys get -707 and lose their session (as Mooncake)
    MALFORMED = "malformed"  # the whole call answers `result` (wrong count, bool, None, ...)
    RAISE = "raise"  # the whole call raises `exc`
    DELAY = "delay"  # the call waits `delay_s` (or until rule `after` fired; cut short by `release()`)
    THEN = "then"  # `action(keys, per_key)` runs after the inner call returned, before the caller sees it


@dataclass(frozen=True, slots=True, eq=False)
class Fault:
    """One rule. It matches a call of one of `methods` (at `layer_idx`, if set) that has at
    least one key accepted by `keys` (None: any call). `times=None` keeps it forever; an int
    counts the calls it fires on. `forward`: MALFORMED / RAISE after the inner call ran.
    `add` returns a copy whose `name` is unique (the call log names the rules that fired)."""

    kind: FaultKind
    methods: frozenset[str]
    keys: Callable[[ObjectKey], bool] | None = None
    layer_idx: int | None = None
    code: int = int(Code.TRANSFER_FAIL)
    result: object = None
    exc: BaseException | None = None
    delay_s: float = 0.0
    forward: bool = False
    times: int | None = None
    name: str = ""
    after: Fault | None = None  # DELAY: wait until this rule fired (delay_s bounds the wait)
    entered: threading.Event = field(default_factory=threading.Event)  # set when a call it fires on enters
    action: Callable[[list[ObjectKey], tuple[Sequence[Any], ...]], None] | None = None  # THEN


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
        self._rules: dict[Fault, int | None] = {}  # guarded by _lock: rule -> calls left
        self._calls: list[CallRecord] = []  # guarded by _lock
        self._seq = itertools.count()  # next() is atomic under the GIL; used under _lock anyway
        self._released = threading.Event()

    # ---- rules -------------------------------------------------------------------------------
    def add(self, rule: Fault) -> Fault:
        unknown = sorted(rule.methods - set(ALL_METHODS))
        if unknown or not rule.methods:
            raise ValueError(f"fault rule methods {sorted(rule.methods)}: unknown {unknown}; known: {ALL_METHODS}")
        if rule.times is not None and rule.times < 1:
            raise ValueError(f"fault rule times={rule.times} must be >= 1 or None (persistent)")
        rule = dataclasses.replace(
            rule, name=f"{rule.name or rule.kind.value}#{next(_rule_ids)}", entered=threading.Event()
        )
        with self._lock:
            self._rules[rule] = rule.times
        return rule

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
        return self.add(
            Fault(
                FaultKind.FAIL,
                _methods(methods),
                _match(keys),
                layer_idx,
                code=int(code),
                times=times,
                name=f"fail {_label(methods)}",
            )
        )

    def expire_lease(self, keys: KeyMatch = None, *, layer_idx: int | None = None, times: int | None = None) -> Fault:
        """Range reads of matching keys answer -707 and their get session is dropped."""
        return self.add(
            Fault(
                FaultKind.EXPIRE,
                frozenset({GET_RANGES}),
                _match(keys),
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
            Fault(
                FaultKind.MALFORMED,
                _methods(methods),
                _match(keys),
                layer_idx,
                result=result,
                forward=forward,
                times=times,
                name=f"malformed {_label(methods)}",
            )
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
        return self.add(
            Fault(
                FaultKind.RAISE,
                _methods(methods),
                _match(keys),
                layer_idx,
                exc=exc,
                forward=forward,
                times=times,
                name=f"raise {_label(methods)}",
            )
        )

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
        return self.add(
            Fault(
                FaultKind.DELAY,
                _methods(methods),
                _match(keys),
                layer_idx,
                delay_s=delay_s,
                times=times,
                after=after,
                name=f"delay {_label(methods)}",
            )
        )

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
        return self.add(
            Fault(
                FaultKind.THEN,
                _methods(methods),
                _match(keys),
                layer_idx,
                times=times,
                action=action,
                name=f"then {_label(methods)}",
            )
        )

    def remove(self, rule: Fault) -> None:
        with self._lock:
            self._rules.pop(rule, None)

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
        return self._call(PUT_RANGES, keys, (ptrs, sizes, dst_offsets), layer_idx=layer_idx)  # type: ignore[return-value]

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
        return self._call(GET_RANGES, keys, (ptrs, sizes, src_offsets), layer_idx=layer_idx)  # type: ignore[return-value]

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
            rules = self._take(method, keys, layer_idx)
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

    def _take(self, method: str, keys: list[ObjectKey], layer_idx: int | None) -> list[Fault]:
        """Rules that fire on this call (under _lock); counts down one-shot rules."""
        fired = []
        for rule, left in list(self._rules.items()):
            if method not in rule.methods or (rule.layer_idx is not None and rule.layer_idx != layer_idx):
                continue
            if rule.keys is not None and not any(rule.keys(k) for k in keys):
                continue
            fired.append(rule)
            rule.entered.set()
            if left is not None:
                if left <= 1:
                    del self._rules[rule]
                else:
                    self._rules[rule] = left - 1
        return fired

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
            return _whole_call_fault(whole, method, keys)
        codes: dict[int, int] = {}  # key position -> injected code
        for rule in rules:
            if rule.kind in (FaultKind.FAIL, FaultKind.EXPIRE):
                for i, key in enumerate(keys):
                    if rule.keys is None or rule.keys(key):
                        codes.setdefault(i, rule.code)
        expired = [keys[i] for i, code in codes.items() if code == int(Code.LEASE_EXPIRED) and method == GET_RANGES]
        if expired:
            self.inner.batch_get_session_end(expired)  # Mooncake drops the session on -707
        passed = [i for i in range(len(keys)) if i not in codes]
        inner_result = self._forward(method, keys, passed, per_key, extra, layer_idx) if passed else None
        for rule in rules:
            if rule.kind is FaultKind.THEN and rule.action is not None:
                rule.action(keys, per_key)
        if whole is not None:
            return _whole_call_fault(whole, method, keys)
        if method == GET_END:
            return inner_result if inner_result is not None else (next(iter(codes.values()), 0) if codes else 0)
        if not codes:
            return inner_result
        if not isinstance(inner_result, (list, tuple)) and passed:
            return inner_result  # the inner store's own malformed answer, passed on untouched
        merged: list[object] = [0] * len(keys)
        for i, code in codes.items():
            merged[i] = code
        for i, value in zip(passed, inner_result or ()):  # type: ignore[call-overload]
            merged[i] = value
        return merged

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


def _whole_call_fault(rule: Fault, method: str, keys: list[ObjectKey]) -> object:
    if rule.kind is FaultKind.RAISE:
        raise (
            rule.exc
            if rule.exc is not None
            else RuntimeError(f"injected fault: {method} raised for {len(keys)} keys (first {keys[:1]})")
        )
    return rule.result


def _methods(methods: str | Sequence[str]) -> frozenset[str]:
    return frozenset((methods,) if isinstance(methods, str) else methods)


def _label(methods: str | Sequence[str]) -> str:
    return methods if isinstance(methods, str) else "+".join(methods)


def _match(keys: KeyMatch) -> Callable[[ObjectKey], bool] | None:
    """None (every key), one key, a collection of keys, or a predicate -> a predicate."""
    if keys is None or callable(keys):
        return keys  # type: ignore[return-value]
    if isinstance(keys, str):
        return keys.__eq__  # type: ignore[return-value]
    wanted = frozenset(keys)
    return wanted.__contains__
