"""`layerkv demo --store mooncake|embedded` with read_layers_per_range set (the CLI's own code
path, config replaced; demo defaults untouched). Usage: demo_k.py STORE K [K ...]"""

import os
import statistics
import sys

from layerkv.config import LayerKVConfig
from layerkv.demos.demo import run_demo
from layerkv.store.local_master import LocalMaster

store, ks = sys.argv[1], [int(k) for k in sys.argv[2:]]
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def run(config):
    for k in ks:
        r = run_demo(config.replace(read_layers_per_range=k), progress=False)
        pool = [row.ttft_pool_ms for row in r.rows]
        print(
            f"{store} k={k}: identical={r.identical} TTFT pool ms {[round(p, 1) for p in pool]} median "
            f"{statistics.median(pool):.1f}; "
            f"recompute median {statistics.median(row.ttft_recompute_ms for row in r.rows):.1f}",
            flush=True,
        )


config = LayerKVConfig.from_dict({"backend": store})
if store == "mooncake":
    with LocalMaster() as d:
        run(config.replace(mooncake_config_path=str(d.config_path)))
else:
    run(config)
