"""Recording doubles of layerkv's neutral connectors for tests/vllm: the facade (built by vLLM's
factory) drives them instead of layerkv.connector's SchedulerConnector / WorkerConnector once a
test asks for the `doubles` fixture, and they record every hook call with its arguments. The
scheduler double's "pool" holds the block hashes a test puts in `pool_hashes`. They run on the
test's thread; nothing here imports vLLM."""

from __future__ import annotations

from typing import Any

import pytest


class RecordingScheduler:
    """Double of layerkv.connector.SchedulerConnector: the "pool" holds `pool_hashes`."""

    pool_hashes: set[bytes] = set()  # set per test through the `doubles` fixture
    ask_again: set[str] = set()  # request ids whose lookup answers None ("ask again next step")

    def __init__(self, config: Any, deployment: Any, store: Any = None) -> None:
        self.config, self.deployment = config, deployment
        self.calls: list[tuple[str, tuple]] = []
        self.steps: list[Any] = []
        self.reports: list[Any] = []
        Doubles.schedulers.append(self)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("get_num_new_matched_tokens", (request, num_computed_tokens)))
        if request.req_id in self.ask_again:
            return None, False
        hit_blocks = 0
        for h in request.block_hashes:
            if h not in self.pool_hashes:
                break
            hit_blocks += 1
        # keep at least one prompt token for the engine to compute
        num_tokens = min(
            hit_blocks * self.deployment.block_size,
            (request.num_prompt_tokens - 1) // self.deployment.block_size * self.deployment.block_size,
        )
        return max(0, num_tokens - num_computed_tokens), False

    def match_window(self, request, num_computed_tokens, max_tokens=None):
        """A sliding-window group: the same pool, the hit bounded by `max_tokens`."""
        tokens, _ = self.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens if max_tokens is None else min(tokens, max_tokens)

    def may_hit(self, request):
        self.calls.append(("may_hit", (request,)))
        return bool(request.block_hashes) and request.block_hashes[0] in self.pool_hashes

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("update_state_after_alloc", (request, block_ids, num_external_tokens)))

    def build_connector_meta(self, step):
        self.steps.append(step)
        return {"step_index": len(self.steps) - 1, "step": step}

    def update_connector_output(self, report):
        self.reports.append(report)

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", (request, block_ids)))
        return False, None

    def has_pending_work(self) -> bool:
        return False


class RecordingWorker:
    """Double of layerkv.connector.WorkerConnector: records the hook sequence."""

    def __init__(self, config: Any, deployment: Any, store: Any = None) -> None:
        self.config, self.deployment = config, deployment
        self.calls: list[tuple] = []
        self.kv_caches: dict[str, Any] = {}
        self.load_errors: set[int] = set()  # reported once, then cleared
        self.counters: dict[str, int] = {}
        Doubles.workers.append(self)

    def register_kv_caches(self, kv_caches, num_blocks):
        self.kv_caches = dict(kv_caches)
        self.calls.append(("register_kv_caches", num_blocks))

    def bind_connector_metadata(self, meta):
        self.calls.append(("bind_connector_metadata", meta["step_index"]))

    def start_load_kv(self):
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name):
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids):
        self.calls.append(("get_finished", frozenset(finished_req_ids)))
        return None, None

    def get_block_ids_with_load_errors(self):
        self.calls.append(("get_block_ids_with_load_errors",))
        errors, self.load_errors = self.load_errors, set()
        return errors

    def report_steps(self):
        self.calls.append(("report_steps",))
        return ()

    def clear_connector_metadata(self):
        self.calls.append(("clear_connector_metadata",))

    def stats(self):
        counters, self.counters = self.counters, {}
        return counters

    def shutdown(self):
        self.calls.append(("shutdown",))


class Doubles:
    schedulers: list[RecordingScheduler] = []
    workers: list[RecordingWorker] = []


@pytest.fixture
def doubles(monkeypatch):
    """Make the facade build recording doubles instead of layerkv.connector's classes."""
    import layerkv.integrations.vllm.sides as sides

    monkeypatch.setattr(Doubles, "schedulers", [])
    monkeypatch.setattr(Doubles, "workers", [])
    monkeypatch.setattr(RecordingScheduler, "pool_hashes", set())
    monkeypatch.setattr(RecordingScheduler, "ask_again", set())
    monkeypatch.setattr(sides, "SCHEDULER_SIDE", RecordingScheduler)
    monkeypatch.setattr(sides, "WORKER_SIDE", RecordingWorker)
    return Doubles
