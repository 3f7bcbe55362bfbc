"""What a worker registers with the store, and when: its staging areas once at start-up; a
refusal (the master unreachable) is retried on a transfer thread, never on the compute thread,
at most once per store_retry_interval_s, while the engine serves without the pool."""

from __future__ import annotations

import threading
import time

from layerkv.errors import StoreError
from layerkv.store.faults import PUT_START, FaultyStore
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def test_a_refused_registration_is_retried_off_the_compute_thread(make_rig, monkeypatch) -> None:
    threads: list[str] = []
    refuse = threading.Event()
    refuse.set()
    register = FaultyStore.register_buffer

    def registering(self: FaultyStore, ptr: int, nbytes: int) -> None:
        if not threading.current_thread().name.startswith("layerkv-manifest"):  # the scheduler's manifest buffer
            threads.append(threading.current_thread().name)
        if refuse.is_set():
            raise StoreError("injected: the master is unreachable")
        register(self, ptr, nbytes)

    monkeypatch.setattr(FaultyStore, "register_buffer", registering)
    rig = make_rig(transfer_plan="groups", read_layers_per_range=2, store_retry_interval_s=0.05, num_blocks=128)
    worker = rig.workers[0]
    assert threads == [threading.current_thread().name]  # start-up: the caller's thread, once
    rig.run(Req("a", block_tokens(3, BLOCK_SIZE)))  # served without the pool: nothing saved
    assert rig.faults[0].keys_sent(PUT_START) == [] and worker._memory.regions() == []
    refuse.clear()
    for i in range(10):  # bounded: a step queues a retry once the interval has passed; it runs on the write thread
        if worker._memory.regions():
            break
        retry = worker._memory._retry
        if retry is not None:
            assert retry.wait_finished(5.0)
        time.sleep(rig.config.store_retry_interval_s)  # the interval itself must pass (a timer, not a sync)
        rig.run(Req(f"b{i}", block_tokens(1, BLOCK_SIZE, base=100 * (i + 1))))
    assert worker._memory.regions(), "the staging areas were never registered"
    assert len(threads) > 1 and all(name.startswith("layerkv-write-") for name in threads[1:]), threads
    rig.run(Req("c", block_tokens(3, BLOCK_SIZE, base=5000)))
    assert rig.faults[0].keys_sent(PUT_START), "registered, yet nothing was saved"
