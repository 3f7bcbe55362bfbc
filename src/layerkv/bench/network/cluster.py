"""`layerkv bench network`'s cluster: python -m layerkv.bench.network.cluster <job.json>, run by
the suite (layerkv.bench.network.suite) inside a private network namespace. Makes a namespace cluster
of three hosts (a master host, a storage host, the consumer's host; layerkv.bench.cluster.pool),
then for each link rate shapes what the switch sends the consumer (tc tbf; none: unshaped) and
runs layerkv.bench.network.host on the consumer host; with the job's `engine_python`, then the
real vLLM engines of layerkv.bench.network.engines (on a fourth host, the producer's); writes the
cells to the job's `out`.
Removes the cluster on exit. Main thread only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from layerkv.bench.cluster.pool import started_pool
from layerkv.bench.network import engines

HOSTS = ("master", "store", "consumer")  # and the producer host when vLLM engines run
CELL_TIMEOUT_S = 1800.0  # one rate's measurements (bounded: the reference engine's few prompts)


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    work = Path(job_path).parent
    results = []
    vllm: dict[str, object] | None = None
    hosts = HOSTS + (("producer",) if job.get("engine_python") else ())
    with started_pool(work, hosts, storage=("store",), segment=job["segment"]) as pool:
        for i, rate in enumerate(job["rates"]):
            if rate:
                pool.cluster.limit("consumer", rate)
            else:
                pool.cluster.unlimit("consumer")
            host_job = {
                "prompt_tokens": job["prompt_tokens"],
                "quick": job["quick"],
                "tiny": job["tiny"],
                "write": i == 0,
            }
            proc = pool.run_module("consumer", "layerkv.bench.network.host", host_job, f"consumer-{i}")
            try:
                cells = json.loads(proc.line("@@", CELL_TIMEOUT_S))
            finally:
                proc.stop()
            results.append({"rate": rate or "unshaped", "cells": cells})
            print(f"network: {rate or 'unshaped'} done", file=sys.stderr, flush=True)
        pool.cluster.unlimit("consumer")
        if job.get("engine_python"):
            (work / "vllm").mkdir()
            vllm = engines.run(pool, job["engine_python"], job["rates"], job["quick"], work / "vllm")
    Path(job["out"]).write_text(json.dumps({"reference": results, "vllm": vllm}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
