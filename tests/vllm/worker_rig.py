"""The worker side of tests/vllm: a worker-role layerkv facade built by vLLM's factory, installed
as the process's KV transfer agent and driven through vLLM's own model-runner hooks
(ActiveKVConnector, the per-layer `maybe_transfer_kv_layer` wrapper) over CPU caches that
vLLM's `allocate_kv_cache` made; the `clean_agent` fixture uninstalls it. Runs on the test's
thread; the facade's transfer threads are layerkv's own."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.vllm.vllm_harness import LAYERS, Engine


@dataclass
class WorkerRig:
    """A worker-role facade created by vLLM's factory, installed as the process's KV transfer
    agent and driven by vLLM's own `ActiveKVConnector` (vllm/v1/worker/gpu/kv_connector.py: how
    the model runner drives a connector in 0.33 and 0.34, byte-identical in both), with LAYERS
    bound to CPU caches vLLM's `allocate_kv_cache` made for the engine's layout (logical
    [B, H, N, 2*head] views per layer)."""

    connector: Any
    runner: Any  # ActiveKVConnector
    kv_caches: dict = field(default_factory=dict)
    full_graphs: bool = False  # the engine's config replays uniform decode batches as full CUDA graphs
    replays: int = 0  # steps run as a full graph replay: no per-layer hook

    def replayed(self, scheduler_output) -> bool:
        """Would vLLM 0.34 replay this step as one full CUDA graph? Its rule (gpu/model_runner.py
        gather_batch_req_state, then utils.get_uniform_decode_token_count): every request computes
        the uniform decode query length (1 here: no drafter), each one decoding or computing one
        prompt token over an existing context. (Batches above the largest captured size run
        piecewise in vLLM; treating them as replayed only makes the tests stricter.)"""
        from vllm.v1.worker.utils import get_uniform_decode_token_count

        counts = scheduler_output.num_scheduled_tokens
        if not self.full_graphs or not counts:
            return False
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed.update((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs)
        eligible = all(computed[req_id] > 0 for req_id in counts)
        return (
            get_uniform_decode_token_count(
                len(counts), scheduler_output.total_num_scheduled_tokens, max(counts.values()), eligible
            )
            == 1
        )

    def run_step(self, scheduler_output, run_layer=None, defer_finalize: bool = False):
        """One model-runner step as vLLM's GPU model runner takes it: a step with no scheduled
        token goes through `no_forward`; otherwise `pre_forward` inside the forward context,
        one attention call per layer through the real per-layer `@maybe_transfer_kv_layer`
        wrapper (`run_layer(name)` is the attention body: it runs after the layer's load wait,
        before its save), `finish_forward`, `post_forward`, and with `defer_finalize` (what the
        runner does with a speculator) `finalize_step` after the output was taken."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        @maybe_transfer_kv_layer
        def attention(query, layer_name):  # same wrapper as unified_attention_with_output
            if run_layer is not None:
                run_layer(layer_name)
            return query

        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # this node's worker (tests run several)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.runner.no_forward(scheduler_output).kv_connector_output
        vllm_config = self.connector._vllm_config
        replay = self.replayed(scheduler_output)
        self.replays += replay
        with set_forward_context({n: object() for n in LAYERS}, vllm_config, slot_mapping={}):
            self.runner.pre_forward(scheduler_output)
            for name in LAYERS:
                if not replay:
                    attention(None, name)
                elif run_layer is not None:  # the captured graph: the layers' compute, no hook
                    run_layer(name)
        self.runner.finish_forward()
        output = self.runner.post_forward(set(scheduler_output.finished_req_ids), defer_finalize=defer_finalize)
        if defer_finalize:
            self.runner.finalize_step()
        return output


def make_worker(engine: Engine, ranks: Any = None) -> WorkerRig:
    """The worker of rank `ranks` (parallel.ParallelRanks: tp, pp and dcp rank; None: the only
    rank). vLLM's model-parallel groups do not exist in this process, so a rig of several ranks
    hands each worker its ranks through parallel.WORKER_RANKS while vLLM's factory builds it."""
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.utils import allocate_kv_cache

    import layerkv.integrations.vllm.parallel as parallel

    seam = parallel.WORKER_RANKS
    if ranks is not None:
        parallel.WORKER_RANKS = lambda _config: ranks
    try:
        connector = KVConnectorFactory.create_connector(
            engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config
        )
    finally:
        parallel.WORKER_RANKS = seam
    kv_transfer_state._KV_CONNECTOR_AGENT = connector  # what ensure_kv_transfer_initialized sets
    layout = KVCacheLayout[engine.kv_cache_config.kv_cache_layout]
    kv_caches = allocate_kv_cache(engine.kv_cache_config, torch.device("cpu"), layout)  # vLLM's own views
    runner = ActiveKVConnector(engine.vllm_config, kv_caches)  # registers the caches, as the model runner does
    mode = engine.vllm_config.compilation_config.cudagraph_mode
    forward_context = engine.vllm_config.compilation_config.static_forward_context
    for name in LAYERS:  # stand-in Attention layers: what get_attention_context reads
        forward_context[name] = types.SimpleNamespace(kv_cache=kv_caches[name])
    full_graphs = mode is not None and mode.has_full_cudagraphs() and not engine.vllm_config.model_config.enforce_eager
    return WorkerRig(connector, runner, kv_caches, full_graphs=full_graphs)


@pytest.fixture
def clean_agent():
    """Uninstall the worker connector from vLLM's process-global slot after the test."""
    yield
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = None
