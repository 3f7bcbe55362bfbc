"""Prefill/decode disaggregation: a decode request never races the prefill server's commit.

A prefill server (a role that saves) names, in the `kv_transfer_params` of each finished
request, the prefix it commits to the pool: {PREFIX_TOKENS: n}, every full block of the prompt.
A proxy hands those params to the decode server with the same prompt. There a lookup that finds
less than that prefix answers "ask again" (None): the engine schedules other requests and asks
next step, until the whole prefix is in the pool or `prefill_wait_s` has passed; then the
request loads what is there and computes the rest. A prefill server that dies before its commit
costs one bounded wait and a recompute, never a hang or a wrong token: what is read is what any
lookup reads (COMPLETE objects, verified per layer).

In vLLM each connector names its promise under its own pool's key, `pool_promise_key`
(PREFIX_TOKENS@<digest of the pool>): vLLM's MultiConnector refuses a key two of its connectors
return, and a decode server on one of several pools must find the promise meant for it
(integrations/vllm/pools.py maps the keys to PREFIX_TOKENS, which this module reads).

Polls of one request are at most one per POLL_S (a waiting request costs the engine's loop no
store round trip in between). Scheduler thread only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from layerkv.connector.stats import SchedulerStats
from layerkv.messages import ReqId

PREFIX_TOKENS = "layerkv_prefix_tokens"  # the kv_transfer_params key
POLL_S = 0.005


def pool_promise_key(pool: str) -> str:
    """The kv_transfer_params key of the prefix promised in one pool (`pool`: store.factory.
    pool_identity): a short digest, so a client or proxy sees no address or tenant."""
    return f"{PREFIX_TOKENS}@{hashlib.blake2b(pool.encode(), digest_size=6).hexdigest()}"


def promised_tokens(params: Mapping[str, Any] | None) -> int:
    """The prefix (tokens) a prefill server said it commits; 0 if none or malformed."""
    if not params:
        return 0
    value = params.get(PREFIX_TOKENS)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class PrefillWaits:
    """Per request: when it started waiting and when it may poll the pool again."""

    def __init__(self, wait_s: float, stats: SchedulerStats, clock: Callable[[], float] = time.monotonic) -> None:
        self._wait_s, self._stats, self._clock = wait_s, stats, clock
        self._since: dict[ReqId, float] = {}
        self._next_poll: dict[ReqId, float] = {}

    def too_soon(self, req_id: ReqId) -> bool:
        """This request polled less than POLL_S ago: answer "ask again" without a lookup."""
        return self._clock() < self._next_poll.get(req_id, 0.0)

    def keep_waiting(self, req_id: ReqId) -> bool:
        """The pool lacks part of the promised prefix: True while the request may wait longer
        (its clock starts at the first call); False once prefill_wait_s has passed (counted as a
        timeout, the request then stops waiting for good)."""
        now = self._clock()
        since = self._since.setdefault(req_id, now)
        if since == now and req_id not in self._next_poll:
            self._stats.prefill_waits += 1
        if now - since < self._wait_s:
            self._next_poll[req_id] = now + POLL_S
            return True
        self._stats.prefill_wait_timeouts += 1
        self.done(req_id)
        self._since[req_id] = float("-inf")  # never waits again
        return False

    def waited_out(self, req_id: ReqId) -> bool:
        return self._since.get(req_id) == float("-inf")

    def done(self, req_id: ReqId) -> None:
        """The prefix is there (or the wait ended): record the time waited."""
        since = self._since.pop(req_id, None)
        self._next_poll.pop(req_id, None)
        if since is not None and since != float("-inf"):
            self._stats.prefill_wait_ms += int((self._clock() - since) * 1000)

    def forget(self, req_id: ReqId) -> None:
        """The request finished or was aborted."""
        self._since.pop(req_id, None)
        self._next_poll.pop(req_id, None)
