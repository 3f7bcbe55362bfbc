"""What a store fault costs one request, on a real mooncake_master (the chaos tier's rig: master
and segment holder in processes of their own), with the demo model (8 layers, hidden 256, block
16) and every layerkv timeout at its default. Each figure: the median TTFT over `reps` requests
of a 512-token prefix + 16-token question, the prefix in the pool.

Usage: PYTHONPATH=src:. python scripts/chaos/fault_costs.py [reps]
"""

from __future__ import annotations

import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from layerkv.config import LayerKVConfig
from layerkv.demos.demo import DEMO_MODEL
from layerkv.engine import EngineConfig, block_hashes
from layerkv.objects.keys import block_keys
from tests.chaos.engines import LocalOracle
from tests.chaos.rig import InProc, Rig

ENGINE = EngineConfig(block_size=16, num_blocks=512, max_num_batched_tokens=512, max_num_seqs=4)
DEFAULTS = {
    f: getattr(LayerKVConfig(), f)
    for f in ("load_timeout_s", "save_timeout_s", "store_call_timeout_s", "store_retry_interval_s")
}
PREFIX_BLOCKS, QUESTION = 32, 16


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.0f} ms (min {min(values) * 1e3:.0f}, max {max(values) * 1e3:.0f})"


def keys_of(engine: InProc, prompt: list[int]) -> list[str]:
    worker = engine.chaos.workers[0]
    return block_keys(worker.namespace, block_hashes(prompt, ENGINE.block_size), 0)


def flip_layer(rig: Rig, consumer: InProc, key: str, layer_idx: int) -> None:
    """Rewrite `key` in the store with 16 bytes of `layer_idx` flipped (header untouched)."""
    layout = consumer.chaos.workers[0].layout
    buf = np.zeros(layout.object_nbytes, dtype=np.uint8)
    rig.probe.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        assert rig.probe.batch_get_into([key], [buf.ctypes.data], [buf.nbytes]) == [buf.nbytes]
        at = layout.layer_offset(layer_idx) + 8
        buf[at : at + 16] ^= 0xFF
        assert rig.probe.batch_remove([key]) == [0]
        assert rig.probe.batch_put_from([key], [buf.ctypes.data], [buf.nbytes]) == [0]
    finally:
        rig.probe.unregister_buffer(buf.ctypes.data)


def main(reps: int) -> None:
    oracle = LocalOracle(DEMO_MODEL, ENGINE)
    with tempfile.TemporaryDirectory(prefix="layerkv-fault-costs-") as tmp:
        rig = Rig("fault-costs", 1, Path(tmp), oracle, model=DEMO_MODEL, engine=ENGINE, segment_bytes=512 << 20)
        try:
            producer = rig.inproc("producer", **DEFAULTS)
            object_faults(rig, producer, reps)
            hung_master(rig)
            stalled_holder(rig, producer)
            killed_master(rig)
        finally:
            rig.close()
            oracle.close()


def measure(rig: Rig, costs: dict[str, list[float]], name: str, engine: InProc, prompt: list[int]) -> dict:
    """Serve `prompt`, check it equals local compute (whatever it cost) and add its TTFT to costs[name]."""
    out = engine.serve([prompt], 2)[0]
    rig.check(engine, [out], 600.0)
    costs.setdefault(name, []).append(out["ttft_s"])
    return out


def object_faults(rig: Rig, producer: InProc, reps: int) -> None:
    """Recompute, a clean hit and a flipped layer in the middle / first block, `reps` times each."""
    costs: dict[str, list[float]] = {}
    for rep in range(reps):
        prefixes = [rig.prefix(PREFIX_BLOCKS) for _ in range(4)]
        producer.serve([p + [1] * QUESTION for p in prefixes], 2)
        consumer = rig.inproc(f"consumer-{rep}", **DEFAULTS)
        consumer.serve([rig.prompt(rig.prefix(2))], 2)  # warm-up: first-step costs out of the way
        measure(rig, costs, "recompute (prefix not in the pool)", consumer, rig.prompt(rig.prefix(PREFIX_BLOCKS), 1))
        measure(rig, costs, "clean pool hit", consumer, rig.prompt(prefixes[0], 1))
        flip_layer(rig, consumer, keys_of(consumer, prefixes[1])[PREFIX_BLOCKS // 2], 3)
        out = measure(rig, costs, "checksum failure in block 16 of 32", consumer, rig.prompt(prefixes[1], 1))
        assert out["external"] == PREFIX_BLOCKS * 16, out["external"]
        flip_layer(rig, consumer, keys_of(consumer, prefixes[2])[0], 3)
        measure(rig, costs, "checksum failure in block 0 of 32", consumer, rig.prompt(prefixes[2], 1))
    for name, values in costs.items():
        print(f"{name:36s} TTFT {ms(values)}", flush=True)


def hung_master(rig: Rig) -> None:
    """A hung master: the first request after the hang begins, and the next ones."""
    consumer = rig.inproc("hung-consumer", **DEFAULTS)
    consumer.serve([rig.prompt(rig.prefix(2))], 2)
    prompts = [rig.prompt(rig.prefix(PREFIX_BLOCKS), 1) for _ in range(4)]
    rig.master.signal(signal.SIGSTOP)
    try:
        outs = consumer.serve(prompts, 2)
    finally:
        rig.master.signal(signal.SIGCONT)
    rig.check(consumer, outs, 600.0)
    print(
        "hung master (SIGSTOP), requests in order: TTFT " + ", ".join(f"{o['ttft_s'] * 1e3:.0f} ms" for o in outs),
        flush=True,
    )


def stalled_holder(rig: Rig, producer: InProc) -> None:
    """A stalled segment holder: the first request whose load and save reach it."""
    consumer = rig.inproc("stall-consumer", **DEFAULTS, transfer_plan="layers")
    consumer.serve([rig.prompt(rig.prefix(2))], 2)
    prefix = rig.prefix(PREFIX_BLOCKS)
    producer.serve([prefix + [2] * QUESTION], 2)
    rig.holder.signal(signal.SIGSTOP)
    try:
        outs = consumer.serve([rig.prompt(prefix, 1), rig.prompt(rig.prefix(PREFIX_BLOCKS), 1)], 2)
    finally:
        rig.holder.signal(signal.SIGCONT)
    rig.check(consumer, outs, 600.0)
    print(
        "segment holder stopped, requests in order: TTFT "
        + ", ".join(f"{o['ttft_s'] * 1e3:.0f} ms" for o in outs)
        + " (wall "
        + ", ".join(f"{o['wall_s']:.1f} s" for o in outs)
        + ")",
        flush=True,
    )


def killed_master(rig: Rig) -> None:
    """A killed master (connections reset): the first request after it died, and the next."""
    consumer = rig.inproc("dead-consumer", **DEFAULTS)
    consumer.serve([rig.prompt(rig.prefix(2))], 2)
    rig.kill_master()
    outs = consumer.serve([rig.prompt(rig.prefix(PREFIX_BLOCKS), 1) for _ in range(3)], 2)
    rig.check(consumer, outs, 600.0)
    print(
        "master killed, requests in order: TTFT " + ", ".join(f"{o['ttft_s'] * 1e3:.0f} ms" for o in outs), flush=True
    )


if __name__ == "__main__":
    started = time.monotonic()
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    print(f"({time.monotonic() - started:.0f} s)")
