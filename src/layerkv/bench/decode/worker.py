"""Suite `decode`'s worker side: a worker-role connector built by vLLM's factory, installed as
the process's KV transfer agent and driven through vLLM's REAL `ActiveKVConnector` and per-layer
`maybe_transfer_kv_layer` wrapper on CPU caches vLLM allocated (`Worker.run_step`: one
model-runner step with no attention body), and what a vLLM worker process has that this driver
lacks (`worker_process_state`). Driver thread only (it plays the model-runner thread); the
connector's own threads run beside it. Imports vllm and torch only inside functions.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Worker:
    """A worker-role connector built by vLLM's factory, installed as the process's KV transfer
    agent and driven by vLLM's own `ActiveKVConnector`, with every layer bound to CPU caches
    vLLM's `allocate_kv_cache` made (logical [B, H, N, 2*head] views per layer)."""

    connector: Any
    runner: Any  # vllm.v1.worker.gpu.kv_connector.ActiveKVConnector
    layers: list[str]
    vllm_config: Any
    kv_caches: dict[str, Any] = field(default_factory=dict)

    def run_step(self, scheduler_output: Any) -> Any:
        """One model-runner step as vLLM's GPU model runner takes it: `pre_forward` inside the
        forward context, one attention call per layer through the real `@maybe_transfer_kv_layer`
        wrapper (no attention body), `finish_forward`, `post_forward`."""
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        @maybe_transfer_kv_layer
        def attention(query: Any, layer_name: str) -> Any:  # same wrapper as unified_attention_with_output
            return query

        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.runner.no_forward(scheduler_output).kv_connector_output
        with set_forward_context({n: object() for n in self.layers}, self.vllm_config, slot_mapping={}):
            self.runner.pre_forward(scheduler_output)
            for name in self.layers:
                attention(None, name)
        self.runner.finish_forward()
        return self.runner.post_forward(set(scheduler_output.finished_req_ids))


def make_worker(vllm_config: Any, kv_cache_config: Any, layers: list[str]) -> Worker:
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.utils import allocate_kv_cache

    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = connector  # what ensure_kv_transfer_initialized sets
    try:
        layout = KVCacheLayout[kv_cache_config.kv_cache_layout]
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        runner = ActiveKVConnector(vllm_config, kv_caches)  # registers the caches, as the model runner does
    except BaseException:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        connector.shutdown()
        raise
    forward_context = vllm_config.compilation_config.static_forward_context
    for name in layers:  # stand-in Attention layers: what get_attention_context reads
        forward_context[name] = types.SimpleNamespace(kv_cache=kv_caches[name])
    return Worker(connector, runner, layers, vllm_config, kv_caches)


@contextlib.contextmanager
def worker_process_state(vllm_config: Any, work_dir: Path) -> Iterator[None]:
    """What a vLLM worker process has and this driver lacks, for a connector that reads it
    (vLLM's MooncakeStoreConnector asks for its tensor / pipeline / context parallel ranks): the
    model-parallel groups of a world of one (gloo, rendezvous through a file in `work_dir`),
    destroyed on exit. On a machine without CUDA also a harness-only stand-in for
    `torch.cuda.Event` (record / synchronize do nothing): a connector that orders its saves
    after the forward's kernels with a CUDA event has nothing to wait for here, since this
    harness runs no kernel; restored on exit."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            stack.enter_context(_no_op_cuda_events(torch))
        with set_current_vllm_config(vllm_config):
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{work_dir / 'dist-init'}",
            )
            stack.callback(parallel_state.destroy_distributed_environment)
            parallel_state.ensure_model_parallel_initialized(1, 1)
            stack.callback(parallel_state.destroy_model_parallel)
        yield


class _NoOpEvent:
    """Stand-in for torch.cuda.Event on CPU (see worker_process_state)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _no_op_cuda_events(torch: Any) -> Iterator[None]:
    saved = torch.cuda.Event
    torch.cuda.Event = _NoOpEvent
    try:
        yield
    finally:
        torch.cuda.Event = saved
