"""One contender's servers for `layerkv bench load`: its pool (a `layerkv master` child for
layerkv and MooncakeStoreConnector, an LMCache server for LMCache, none for no connector) and
its `vllm serve` servers, each with the scenario's local KV cache, started at once and stopped
together. Driver thread only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from layerkv.bench.load.plan import (
    BLOCK_SIZE,
    LAYERKV_CONSUMER,
    LAYERKV_KINDS,
    LAYERKV_PROMPTS,
    LMCACHE,
    MOONCAKE,
    MOONCAKE_SAVE_DECODE,
    LoadPlan,
    Scenario,
)
from layerkv.bench.load.probe import LogPhases
from layerkv.bench.vllm.engines import engine_env
from layerkv.bench.vllm.serve_proc import ServeProcess
from layerkv.store.mooncake_master import MasterPorts

SERVED_NAME = "load-model"
LAYERKV_EXTRA: dict[str, Any] = {"backend": "mooncake", "tenant": "bench-load"}


def cpu_binds(num_servers: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per server: one server computes on every CPU; several split them."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if num_servers == 1 or len(cpus) < num_servers:
        return [",".join(map(str, cpus))] * num_servers
    share = len(cpus) // num_servers
    return [",".join(map(str, cpus[i * share : (i + 1) * share])) for i in range(num_servers)]


class ContenderFleet:
    """`contender`'s pool and servers for `scenario`; `servers` are ready after `ready()`."""

    def __init__(
        self,
        plan: LoadPlan,
        scenario: Scenario,
        contender: str,
        model: Path,
        work_dir: Path,
        pythons: dict[str, str],
        pythonpath: Path,
        layerkv_extra: dict[str, Any] | None = None,
    ) -> None:
        """`pythons`: contender -> the Python that runs its servers (LMCache has its own venv)."""
        self.contender, self.work_dir = contender, work_dir
        self.master: Any = None  # LocalMaster for the Mooncake contenders
        self.lmcache: Any = None  # lmcache.LMCacheServer
        self.servers: list[ServeProcess] = []
        self.logs: dict[str, LogPhases] = {}
        self._layerkv_extra = {**LAYERKV_EXTRA, **(layerkv_extra or {})}
        try:
            pool_env = self._start_pool(plan.pool_bytes(scenario), pythons)
            for i, bind in enumerate(cpu_binds(scenario.num_servers)):
                name = f"{contender}-{i}"
                argv = [
                    pythons[contender],
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(model),
                    *self._flags(plan, scenario, i),
                ]
                port = MasterPorts.pick().rpc_port  # a free loopback port
                env = engine_env(
                    pythonpath, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind, **pool_env}
                )
                server = ServeProcess(name, [*argv, "--port", str(port)], port, env, work_dir)
                self.logs[name] = LogPhases(server.log_path)
                self.logs[name].mark("start")
                self.servers.append(server)
        except BaseException:
            self.stop()
            raise

    def _start_pool(self, pool_bytes: int, pythons: dict[str, str]) -> dict[str, str]:
        """Start the contender's pool; the servers' environment for it."""
        if self.contender in (*LAYERKV_KINDS, MOONCAKE, MOONCAKE_SAVE_DECODE):
            from layerkv.store.local_master import LocalMaster

            self.master = LocalMaster(segment_size=str(pool_bytes))
            config: dict[str, Any] = dict(self.master.client_config)
            if self.contender in (
                MOONCAKE,
                MOONCAKE_SAVE_DECODE,
            ):  # standalone-store: mounts nothing, every object in the master's segment
                config.update(mode="standalone-store", global_segment_size=0, local_buffer_size=256 << 20)
            path = self.work_dir / f"mooncake-{self.contender}.json"
            path.write_text(json.dumps(config))
            return {"MOONCAKE_CONFIG_PATH": str(path)}
        if self.contender == LMCACHE:
            from layerkv.bench.load.lmcache import LMCacheServer

            self.lmcache = LMCacheServer(pythons[LMCACHE], self.work_dir, pool_bytes, {})
            self.lmcache.ready(120)
            return dict(self.lmcache.engine_env())
        return {}

    def _flags(self, plan: LoadPlan, scenario: Scenario, index: int) -> list[str]:
        flags = [
            "--host",
            "127.0.0.1",
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            plan.model.dtype,
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(plan.workload.max_model_len),
            "--num-gpu-blocks-override",
            str(plan.local_blocks(scenario)),
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prompt-tokens-details",
            "--uvicorn-log-level",
            "warning",
            "--shutdown-timeout",
            "30",
        ]  # drain on SIGTERM (vLLM's default 0 aborts: EngineDeadError logged)
        transfer = self.transfer_config(index)
        return flags + (["--kv-transfer-config", json.dumps(transfer)] if transfer else [])

    def transfer_config(self, index: int) -> dict[str, Any] | None:
        """The server's --kv-transfer-config (None: no connector). Every contender recomputes a
        failed load (vLLM's default policy fails the request)."""
        if self.contender in LAYERKV_KINDS:
            extra = {
                **self._layerkv_extra,
                **({"save_decode_blocks": False} if self.contender == LAYERKV_PROMPTS else {}),
            }
            return {
                "kv_connector": "LayerKVConnector",
                "kv_connector_module_path": "layerkv.integrations.vllm",
                "kv_role": "kv_consumer" if self.contender == LAYERKV_CONSUMER else "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        if self.contender in (
            MOONCAKE,
            MOONCAKE_SAVE_DECODE,
        ):  # its lookup server's IPC socket is named after lookup_rpc_port
            return {
                "kv_connector": "MooncakeStoreConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "lookup_rpc_port": (os.getpid() * 8 + index) % 50000 + 10000,
                    **({"save_decode_cache": True} if self.contender == MOONCAKE_SAVE_DECODE else {}),
                },
            }
        if self.contender == LMCACHE:
            return dict(self.lmcache.kv_transfer_config())
        return None

    def ready(self, timeout_s: float = 600) -> None:
        for server in self.servers:
            server.ready(timeout_s)

    def mark(self, phase: str) -> None:
        for log in self.logs.values():
            log.mark(phase)

    def stop_servers(self) -> dict[str, int | None]:
        """Stop the servers (all at once); each one's exit code (None: killed)."""
        self.mark("stop")
        for server in self.servers:
            server.request_stop()
        return {server.name: server.stop() for server in self.servers}

    def stop(self) -> None:
        """The servers, then the pool. Idempotent."""
        self.stop_servers()
        if self.lmcache is not None:
            self.lmcache.stop()
            self.lmcache = None
        if self.master is not None:
            self.master.stop()
            self.master = None
