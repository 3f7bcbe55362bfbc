"""Several layerkv connectors in one vLLM engine (vLLM's MultiConnector over them, e.g. one per
pool): the key each names its prefill promise under, and how a decode server finds the promise
meant for its pool. Scheduler thread only (the dedup record is per thread).

vLLM's MultiConnector merges its children's `request_finished` params and raises on a key two
children return (`Key clash in kv_transfer_params`, out of the engine core's step); a child
cannot see its siblings (MultiConnector hands each a copy of the config with only its own
entry). So every layerkv connector names its promise `layerkv_prefix_tokens@<digest of its
pool>` (connector/prefill_wait.py: the store, where it is, and the tenant), and a decode server
reads, in order: its own pool's key; the plain `layerkv_prefix_tokens` (a client or proxy may
send it); the only `layerkv_prefix_tokens@…` key when there is just one (a prefill server on one
pool that names its master by another address). Two children on the same pool would write the
same objects and promise the same key: the second one's promise for a request is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from layerkv.connector.prefill_wait import PREFIX_TOKENS

log = logging.getLogger(__name__)
_TAGGED = PREFIX_TOKENS + "@"
_emitted = threading.local()  # .request: (id, request id) of the request last named a promise; .keys: its keys


def promise_read(params: Mapping[str, Any], own_key: str) -> Any:
    """The promise meant for the pool whose key is `own_key` (None if there is none)."""
    if own_key in params:
        return params[own_key]
    if PREFIX_TOKENS in params:
        return params[PREFIX_TOKENS]
    tagged = [k for k in params if isinstance(k, str) and k.startswith(_TAGGED)]
    return params[tagged[0]] if len(tagged) == 1 else None


def promise_named(request: Any, params: dict[str, Any] | None, own_key: str) -> dict[str, Any] | None:
    """`params` from the neutral side with its promise (PREFIX_TOKENS) under `own_key`; without
    it when a sibling connector on the same pool already named that key for this very request
    (MultiConnector asks its children one after another for one request object)."""
    if not params or PREFIX_TOKENS not in params:
        return params
    out = {(own_key if k == PREFIX_TOKENS else k): v for k, v in params.items()}
    which = (id(request), getattr(request, "request_id", None))
    if getattr(_emitted, "request", None) != which:
        _emitted.request, _emitted.keys = which, set()
    if own_key in _emitted.keys:
        log.warning(
            "layerkv: two layerkv connectors of this engine write one pool (key %s): they write the same "
            "objects twice; give each its own store or tenant",
            own_key,
        )
        del out[own_key]
        return out or None
    _emitted.keys.add(own_key)
    return out
