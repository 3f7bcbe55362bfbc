"""Where a layerwise TTFT goes beyond compute alone: the overlap suite's 32-layer rig at
transfer ~ compute, each pooled request printed with its TTFT and the time the compute thread
spent waiting for layers (`load_wait_s`); the rest of TTFT - compute alone is the compute thread
running slower while the receive thread works.

    PYTHONPATH=src .venv/bin/python scripts/overlap_waits.py [--repeats 3] [--prefetch 2 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from tempfile import mkdtemp

import torch

from layerkv.bench.common import BenchOptions
from layerkv.bench.overlap import _best, _Rig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the suite
    rig = _Rig(BenchOptions(quick=False, out_dir=Path(mkdtemp())), deep=True)
    try:
        compute = _best(rig.ttft_compute_alone, args.repeats)
        _, transfer0, calls, _ = _best(lambda: rig.ttft_pooled(rig.model.num_layers, 0.0, True), args.repeats)
        delay = max(0.0, (compute - transfer0) / calls)
        print(f"{rig.model.num_layers} layers: compute alone {compute * 1e3:.0f} ms, transfer without delay "
              f"{transfer0 * 1e3:.1f} ms in {calls} range calls, delay {delay * 1e3:.2f} ms per call")
        for prefetch in args.prefetch:
            for _ in range(args.repeats):
                ttft, _, _, waited = rig.ttft_pooled(prefetch, delay, False)
                print(f"prefetch {prefetch}: TTFT {ttft * 1e3:.0f} ms (compute alone + {(ttft - compute) * 1e3:.0f}), "
                      f"compute thread waited for layers {waited * 1e3:.0f} ms")
    finally:
        rig.close()


if __name__ == "__main__":
    main()
