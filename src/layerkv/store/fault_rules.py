"""The fault rules a `FaultyStore` (store/faults.py) applies: what a rule does (`FaultKind`), the
rule itself (`Fault`: which calls and keys it matches, what it answers), `FaultRules`, the table
of armed rules that counts down the one-shot ones, and how injected per-key codes merge with the
inner store's answer. A `Fault` is frozen (its `entered` event is thread-safe); the table is not
thread-safe: its owner guards it (FaultyStore: under its one lock). A bad rule (unknown method,
times < 1) is a ValueError when it is added.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from layerkv.store.base import STORE_CALLS, Code, ObjectKey

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
    `FaultRules.add` returns a copy whose `name` is unique (the call log names the rules that fired)."""

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

    @classmethod
    def of(
        cls, kind: FaultKind, methods: str | Sequence[str], keys: KeyMatch, layer_idx: int | None, **fields: Any
    ) -> Fault:
        """A rule of `kind` on `methods` (one name or several) for `keys` (one key, a collection,
        a predicate; None: every key), named after its kind and methods unless `fields` name it."""
        fields.setdefault("name", f"{kind.value} {label_of(methods)}")
        return cls(kind, methods_of(methods), key_matcher(keys), layer_idx, **fields)

    def hits(self, key: ObjectKey) -> bool:
        """`key` is one this rule picks."""
        return self.keys is None or self.keys(key)

    def matches(self, method: str, keys: list[ObjectKey], layer_idx: int | None) -> bool:
        """This rule fires on a `method` call of `keys` at `layer_idx`."""
        if method not in self.methods or (self.layer_idx is not None and self.layer_idx != layer_idx):
            return False
        return self.keys is None or any(self.keys(k) for k in keys)

    def whole_call_answer(self, method: str, keys: list[ObjectKey]) -> object:
        """What a MALFORMED rule answers for the whole call; a RAISE rule raises instead."""
        if self.kind is FaultKind.RAISE:
            raise (
                self.exc
                if self.exc is not None
                else RuntimeError(f"injected fault: {method} raised for {len(keys)} keys (first {keys[:1]})")
            )
        return self.result


class FaultRules:
    """The armed rules, each with the calls it has left (None: forever). Not thread-safe."""

    def __init__(self) -> None:
        self._left: dict[Fault, int | None] = {}

    def add(self, rule: Fault) -> Fault:
        """Arm a copy of `rule` under a unique name and return it; ValueError for a bad rule."""
        known = tuple(STORE_CALLS)  # every batch call of the protocol
        unknown = sorted(rule.methods - set(known))
        if unknown or not rule.methods:
            raise ValueError(f"fault rule methods {sorted(rule.methods)}: unknown {unknown}; known: {known}")
        if rule.times is not None and rule.times < 1:
            raise ValueError(f"fault rule times={rule.times} must be >= 1 or None (persistent)")
        rule = dataclasses.replace(
            rule, name=f"{rule.name or rule.kind.value}#{next(_rule_ids)}", entered=threading.Event()
        )
        self._left[rule] = rule.times
        return rule

    def remove(self, rule: Fault) -> None:
        self._left.pop(rule, None)

    def clear(self) -> None:
        self._left.clear()

    def __contains__(self, rule: Fault) -> bool:
        return rule in self._left

    def take(self, method: str, keys: list[ObjectKey], layer_idx: int | None) -> list[Fault]:
        """Rules that fire on this call, in the order they were added; marks them entered and
        counts down one-shot rules (disarmed at their last call)."""
        fired = []
        for rule, left in list(self._left.items()):
            if not rule.matches(method, keys, layer_idx):
                continue
            fired.append(rule)
            rule.entered.set()
            if left is not None:
                if left <= 1:
                    del self._left[rule]
                else:
                    self._left[rule] = left - 1
        return fired


def methods_of(methods: str | Sequence[str]) -> frozenset[str]:
    return frozenset((methods,) if isinstance(methods, str) else methods)


def label_of(methods: str | Sequence[str]) -> str:
    return methods if isinstance(methods, str) else "+".join(methods)


def key_matcher(keys: KeyMatch) -> Callable[[ObjectKey], bool] | None:
    """None (every key), one key, a collection of keys, or a predicate -> a predicate."""
    if keys is None or callable(keys):
        return keys  # type: ignore[return-value]
    if isinstance(keys, str):
        return keys.__eq__  # type: ignore[return-value]
    wanted = frozenset(keys)
    return wanted.__contains__


def injected_codes(rules: list[Fault], keys: list[ObjectKey]) -> dict[int, int]:
    """Key position -> the code the first FAIL / EXPIRE rule of `rules` that picks the key injects."""
    codes: dict[int, int] = {}
    for rule in rules:
        if rule.kind in (FaultKind.FAIL, FaultKind.EXPIRE):
            for i, key in enumerate(keys):
                if rule.hits(key):
                    codes.setdefault(i, rule.code)
    return codes


def merged_answer(codes: dict[int, int], passed: list[int], inner_result: object, num_keys: int) -> object:
    """One answer per key: the injected `codes` at their positions, the inner store's answer at
    the `passed` positions (the keys it was sent, in order)."""
    if not codes:
        return inner_result
    if not isinstance(inner_result, (list, tuple)) and passed:
        return inner_result  # the inner store's own malformed answer, passed on untouched
    merged: list[object] = [0] * num_keys
    for i, code in codes.items():
        merged[i] = code
    for i, value in zip(passed, inner_result or ()):  # type: ignore[call-overload]
        merged[i] = value
    return merged
