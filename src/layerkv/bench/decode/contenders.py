"""Suite `decode`'s contenders: the KVTransferConfig each runs with (layerkv on the embedded
store and on Mooncake, vLLM's MooncakeStoreConnector as is and with save_decode_cache, no
connector) and the `layerkv master` children the Mooncake ones need, started for the suite and
stopped after it. Driver thread only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions

LAYERKV_EMBEDDED, LAYERKV_MOONCAKE, NONE = "layerkv-embedded", "layerkv-mooncake", "none"
MOONCAKE_STORE, MOONCAKE_STORE_DECODE = "mooncake-store", "mooncake-store-save-decode"  # the latter: save_decode_cache


@dataclass(frozen=True, slots=True)
class Contender:
    """`transfer_base`: the KVTransferConfig arguments (None: no connector); `env`: set while it
    runs; `worker_process`: the connector needs what a vLLM worker process has (worker.py's
    worker_process_state)."""

    name: str
    transfer_base: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)
    worker_process: bool = False

    def transfer(self, run_tag: str, run_idx: int) -> dict[str, Any] | None:
        """One run's KVTransferConfig arguments: layerkv gets a fresh tenant (nothing saved before
        is ever a hit), MooncakeStoreConnector a fresh lookup socket."""
        if self.transfer_base is None:
            return None
        extra = dict(self.transfer_base.get("kv_connector_extra_config", {}))
        if self.name.startswith("layerkv"):
            extra["tenant"] = run_tag
        if "lookup_rpc_port" in extra:  # names its IPC socket: one per run
            extra["lookup_rpc_port"] = 10000 + (os.getpid() * 64 + run_idx) % 50000
        return {**self.transfer_base, "kv_connector_extra_config": extra}


def _layerkv(name: str, extra: dict[str, Any]) -> Contender:
    return Contender(
        name,
        {
            "kv_connector": "LayerKVConnector",
            "kv_connector_module_path": "layerkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )


@contextlib.contextmanager
def contenders(options: BenchOptions, work_dir: Path, notes: list[str]) -> Iterator[list[Contender]]:
    """layerkv-embedded and none always; the Mooncake contenders (each against its own `layerkv
    master` child on loopback) when asked, installed and inside a private network namespace."""
    found = [_layerkv(LAYERKV_EMBEDDED, {})]
    with contextlib.ExitStack() as stack:
        reason = _mooncake_unusable(options)
        if reason:
            notes.append(f"{LAYERKV_MOONCAKE} and {MOONCAKE_STORE} skipped: {reason}")
        else:
            from layerkv.store.local_master import LocalMaster

            for name in (LAYERKV_MOONCAKE, MOONCAKE_STORE):
                master = stack.enter_context(LocalMaster(segment_size="1GB"))
                config = dict(master.client_config)
                if name == MOONCAKE_STORE:  # as `bench load` runs it: mounts nothing, objects in the master's segment
                    config.update(mode="standalone-store", global_segment_size=0, local_buffer_size=256 << 20)
                path = work_dir / f"mooncake-{name}.json"
                path.write_text(json.dumps(config))
                if name == LAYERKV_MOONCAKE:
                    found.append(_layerkv(name, {"backend": "mooncake", "mooncake_config_path": str(path)}))
                else:
                    found += [
                        _mooncake_store(MOONCAKE_STORE, path, {}),
                        _mooncake_store(MOONCAKE_STORE_DECODE, path, {"save_decode_cache": True}),
                    ]
                    notes.append(_MOONCAKE_STORE_NOTE)
        found.append(Contender(NONE, None))
        yield found


def _mooncake_store(name: str, config_path: Path, extra: dict[str, Any]) -> Contender:
    """vLLM's MooncakeStoreConnector. Its worker reads its client config from MOONCAKE_CONFIG_PATH
    and names itself by vLLM's host IP: loopback here (a private namespace has no other
    address), with Mooncake's transfer engine and gloo bound to it too."""
    env = {
        "MOONCAKE_CONFIG_PATH": str(config_path),
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    return Contender(
        name,
        {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"lookup_rpc_port": 0, **extra},
        },
        env=env,
        worker_process=True,
    )


_MOONCAKE_STORE_NOTE = (
    f"{MOONCAKE_STORE}: vLLM's MooncakeStoreConnector, standalone-store client (as `bench load` runs it), defaults: it "
    f"saves prompt blocks only; {MOONCAKE_STORE_DECODE}: the same with save_decode_cache=true (it also saves the "
    "blocks decode fills, as layerkv does). Both need what a vLLM worker process has: the bench creates vLLM's "
    "model-parallel groups (a world of one, gloo on loopback) and, with no CUDA here, replaces torch.cuda.Event with "
    "a no-op stand-in during their runs (wait_for_save records a CUDA event for its send thread to synchronise on; "
    "this harness runs no kernel, so there is nothing to order; cudaEventCreate / record are not in its numbers). "
    "Their store calls are not counted (a native MooncakeDistributedStore)."
)


def _mooncake_unusable(options: BenchOptions) -> str:
    from layerkv.bench.backends import mooncake_available

    if not options.mooncake:
        return "--no-mooncake"
    if not mooncake_available():
        return "mooncake (the Python package and mooncake_master) is not installed"
    if os.environ.get("LAYERKV_IN_NETNS") != "1":
        return (
            "Mooncake listens on every interface: run the bench in a private network namespace "
            "(scripts/isolated.sh .venv/bin/layerkv bench decode ...)"
        )
    return ""
