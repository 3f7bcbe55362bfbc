"""Where a layerwise TTFT goes beyond compute alone: the overlap suite's 32-layer rig at
transfer ~ compute, each pooled request printed with its TTFT and the time the compute thread
spent waiting for layers (`load_wait_s`) and the CPU time of layerkv's receive thread (its work
beside the compute); the rest of TTFT - compute alone is the compute thread running slower while
the receive thread works. The load-all-first rows give the receive thread's CPU time with no
compute beside it.

    PYTHONPATH=src .venv/bin/python scripts/overlap_waits.py [--repeats 3] [--prefetch 2 3]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from tempfile import mkdtemp

import torch

from layerkv.bench.common import BenchOptions
from layerkv.bench.micro.overlap_rig import Rig, best_of

_RECV_CPU_S: list[float] = []


def _record_receive_cpu() -> None:
    """Each layerkv receive thread appends its CPU time (time.thread_time) when it ends."""
    run = threading.Thread.run

    def timed_run(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            if self.name.startswith("layerkv-recv"):
                _RECV_CPU_S.append(time.thread_time())

    threading.Thread.run = timed_run  # type: ignore[method-assign]


def _pooled(rig: Rig, prefetch: int, delay: float, load_all: bool) -> tuple[float, float, float]:
    """(TTFT, compute thread's waits, receive thread CPU seconds) of one fresh consumer engine."""
    _RECV_CPU_S.clear()
    ttft, _, _, waited, _, _ = rig.ttft_pooled(prefetch, delay, load_all)
    return ttft, waited, sum(_RECV_CPU_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the suite
    _record_receive_cpu()
    rig = Rig(BenchOptions(quick=False, out_dir=Path(mkdtemp())), deep=True)
    try:
        compute = best_of(rig.ttft_compute_alone, args.repeats)
        _, transfer0, calls, _, _, _ = best_of(lambda: rig.ttft_pooled(rig.model.num_layers, 0.0, True), args.repeats)
        delay = max(0.0, (compute - transfer0) / calls)
        print(
            f"{rig.model.num_layers} layers: compute alone {compute * 1e3:.0f} ms, transfer without delay "
            f"{transfer0 * 1e3:.1f} ms in {calls} range calls, delay {delay * 1e3:.2f} ms per call"
        )
        for _ in range(args.repeats):
            ttft, _, cpu = _pooled(rig, rig.model.num_layers, delay, True)
            print(f"load all, then compute: TTFT {ttft * 1e3:.0f} ms, receive thread CPU {cpu * 1e3:.0f} ms")
        for prefetch in args.prefetch:
            for _ in range(args.repeats):
                ttft, waited, cpu = _pooled(rig, prefetch, delay, False)
                print(
                    f"prefetch {prefetch}: TTFT {ttft * 1e3:.0f} ms (compute alone + {(ttft - compute) * 1e3:.0f}), "
                    f"compute thread waited for layers {waited * 1e3:.0f} ms, receive thread CPU {cpu * 1e3:.0f} ms"
                )
    finally:
        rig.close()


if __name__ == "__main__":
    main()
