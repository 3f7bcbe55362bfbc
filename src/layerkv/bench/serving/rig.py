"""Suite `serving`'s rig: the model, the pool (a `layerkv master` child) and the engines it
measures, each a real vLLM engine process (layerkv.bench.vllm.engines) whose LLM kwargs and
environment `engine_spec` gives (also suite pd's and suite network's engines). Started once per
run, stopped together. Driver thread only (each engine process has its own reader thread).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from layerkv.bench.common import BenchOptions, Progress
from layerkv.bench.serving.grid import BLOCK_SIZE, NAME, Grid
from layerkv.bench.serving.pool_reader import PoolReader
from layerkv.bench.vllm.engines import EngineProcess, engine_env, link_layerkv
from layerkv.bench.vllm.model import save_in

LAYERKV_EXTRA = {"backend": "mooncake", "load_timeout_s": 60, "tenant": "bench-serving"}
DIRECT_EXTRA = {"register_kv_cache": True}  # contender LAYERKV_DIRECT
KEYED_EXTRA = {"tenant_key_file": "<work dir>/tenant.key"}  # LAYERKV_KEYED (its producer too); the path is set per run
ENCRYPTED_EXTRA = {**KEYED_EXTRA, "encrypt_objects": True}  # LAYERKV_ENCRYPTED (its producer too)


def make_model(python: str, pythonpath: Path, work_dir: Path, grid: Grid) -> Path:
    """The grid's random-weight Llama in work_dir/model, made by the engine's Python."""
    return save_in(
        python, engine_env(pythonpath, {}), work_dir / "model", grid.num_layers, grid.hidden_size, grid.dtype
    )


def omp_bind() -> str:
    """Every CPU for vLLM's OpenMP threads in every engine (one engine computes at a time);
    LAYERKV_BENCH_OMP_BIND overrides (e.g. "0": one core for compute)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return os.environ.get("LAYERKV_BENCH_OMP_BIND", ",".join(map(str, cpus)))


class Rig:
    """The model, the pool (a `layerkv master` child) and the six engines, started once."""

    def __init__(
        self, options: BenchOptions, grid: Grid, vllm_version: str, work_dir: Path, progress: Progress
    ) -> None:
        from layerkv.store.local_master import LocalMaster

        self.grid, self.work_dir = grid, work_dir
        self.python, self.vllm_version = os.path.abspath(options.engine_python), vllm_version  # engines run in work_dir
        self.pythonpath = link_layerkv(work_dir)
        progress.case(f"{NAME}: model")
        self.model = make_model(self.python, self.pythonpath, work_dir, grid)
        progress.case(f"{NAME}: pool")
        self.master = LocalMaster(segment_size=str(grid.pool_bytes()))
        self.engines: dict[str, EngineProcess] = {}
        self.reader = PoolReader(
            self.master.info["metrics_url"], self.master.client_config, grid.kv_bytes_per_token * BLOCK_SIZE + 4096
        )  # header <= 4 KiB
        self.prefix_keys: dict[tuple[int, int], list[str]] = {}  # (prefix tokens, repeat) -> its layerkv objects
        self.stopped_counters: dict[str, dict[str, Any]] = {}
        try:
            layerkv_config = work_dir / "mooncake-layerkv.json"
            layerkv_config.write_text(json.dumps(self.master.client_config))
            # vLLM's connector refuses global_segment_size 0 in its "embedded" mode; "standalone-store"
            # mounts nothing, like layerkv's clients: every object of both lives in the master's segment.
            connector_config = work_dir / "mooncake-connector.json"
            connector_config.write_text(
                json.dumps(
                    {
                        **self.master.client_config,
                        "mode": "standalone-store",
                        "global_segment_size": 0,
                        "local_buffer_size": 512 << 20,
                    }
                )
            )
            progress.case(f"{NAME}: starting {len(grid.engines)} vLLM engines")
            for name in grid.engines:
                kwargs, env = self._spec(name, layerkv_config, connector_config)
                self.engines[name] = EngineProcess(name, self.python, kwargs, env, work_dir)
            for engine in self.engines.values():
                engine.ready()
        except BaseException:
            self.close()
            raise

    def _spec(self, name: str, layerkv_config: Path, connector_config: Path) -> tuple[dict[str, Any], dict[str, str]]:
        keyed = name.startswith(("layerkv-keyed", "layerkv-encrypted"))
        return engine_spec(
            self.grid,
            self.model,
            self.pythonpath,
            name,
            layerkv_config,
            connector_config,
            self.key_file() if keyed else None,
        )

    def key_file(self) -> Path:
        """The keyed engines' tenant key (one for all of them: a producer and its consumer share it)."""
        from layerkv.objects.tenant_key import write_key_file

        path = self.work_dir / "tenant.key"
        if not path.exists():
            write_key_file(path)
        return path

    def stop_engine(self, name: str) -> None:
        """Stop one engine now (its counters are read first and kept in `stopped_counters`)."""
        self.stopped_counters[name] = engine_counters(self.engines[name])
        self.engines[name].stop()

    def close(self) -> None:
        for engine in self.engines.values():  # all shut down at once, then each is waited for
            engine.request_stop()
        for engine in self.engines.values():
            engine.stop()
        self.reader.close()
        self.master.stop()


def engine_spec(
    grid: Grid,
    model: Path,
    pythonpath: Path,
    name: str,
    layerkv_config: Path,
    connector_config: Path,
    key_file: Path | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The LLM kwargs and environment of engine `name` (ENGINES of grid.py) on `model`, its
    pool clients configured by `layerkv_config` (layerkv) / `connector_config` (vLLM's
    MooncakeStoreConnector); `key_file`: the keyed engines' tenant key."""
    g = grid
    kwargs: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=g.dtype,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=g.max_model_len,
        max_num_batched_tokens=g.max_model_len,
        gpu_memory_utilization=0.3,
        seed=0,
        disable_log_stats=False,
    )
    env = {"VLLM_CPU_KVCACHE_SPACE": str(g.engine_cache_gib()), "VLLM_CPU_OMP_THREADS_BIND": omp_bind()}
    if name.startswith("layerkv"):
        role = "kv_producer" if name.endswith("producer") else "kv_consumer"
        extra: dict[str, Any] = {**LAYERKV_EXTRA, **(DIRECT_EXTRA if name == "layerkv-direct" else {})}
        if name.startswith(("layerkv-keyed", "layerkv-encrypted")):
            extra.update(
                ENCRYPTED_EXTRA if name.startswith("layerkv-encrypted") else KEYED_EXTRA, tenant_key_file=str(key_file)
            )
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LayerKVConnector",
            "kv_connector_module_path": "layerkv.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        env["MOONCAKE_CONFIG_PATH"] = str(layerkv_config)
    elif name.startswith("mooncake"):
        producer = name.endswith("producer")
        # the lookup server's IPC socket is named after lookup_rpc_port: one per engine
        extra = {"lookup_rpc_port": os.getpid() * 4 + (1 if producer else 2)}
        if producer:
            extra["enable_lookup"] = False  # never loads: its reference runs are local-cache runs
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer",
            "kv_connector_extra_config": extra,
        }
        env["MOONCAKE_CONFIG_PATH"] = str(connector_config)
    return kwargs, engine_env(pythonpath, env)


def engine_counters(engine: EngineProcess) -> dict[str, Any]:
    """The connector counters one engine reports; {"error": ...} if it cannot tell."""
    try:
        return engine.call("counters", timeout_s=60)["counters"]
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc).splitlines()[0]}
