"""The ordering of device copies (transfer/device.py), driven on CPU: the worker's caches take the
device path (torch copies through pinned staging) with a side stream emulated by a thread that
runs each queued copy late. Whatever the lag, compute reads a loaded layer only after its copy
landed, a save writes a layer's bytes only after its copy landed, and a load that gave up lets
no queued copy land in blocks the engine reuses. (The compute side of a save - its copy waits
for the layer's kernels - needs a real device: tests/gpu.)"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import layerkv.connector.worker
from layerkv.messages import KVRole
from layerkv.store.faults import GET_RANGES
from layerkv.transfer.views import CacheViews
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


class LaggingStream:
    """The side streams on CPU, one for loads and one for saves (as on CUDA): each runs its
    queued copies in order on a thread of its own, each `lag_s` after it was queued (and after
    the marker it waits for); markers are threading.Events. The compute "stream" is the calling
    thread: compute_wait blocks it."""

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.compute_waits = 0
        self.errors: list[BaseException] = []
        self._queues: dict[bool, queue.Queue[Any]] = {save: queue.Queue() for save in (False, True)}
        self._threads = [
            threading.Thread(
                target=self._run, args=(q,), name=f"lagging-{'save' if save else 'load'}-stream", daemon=True
            )
            for save, q in self._queues.items()
        ]
        for thread in self._threads:
            thread.start()

    def compute_marker(self) -> threading.Event:
        marker = threading.Event()
        marker.set()  # the host computed everything before this call
        return marker

    def run_after(self, marker: Any, enqueue: Callable[[], None], *, save: bool = False) -> threading.Event:
        done = threading.Event()
        self._queues[save].put((time.monotonic() + self.lag_s, marker, enqueue, done))
        return done

    def host_wait(self, marker: Any) -> None:
        if marker is not None:
            assert marker.wait(10.0), "a queued copy never ran"

    def compute_wait(self, marker: Any) -> None:
        if marker is not None:
            self.compute_waits += 1
            self.host_wait(marker)

    def pinned(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8)

    def index(self, values: Any, device: Any) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64, device=device)

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join(5.0)

    def _run(self, lane: queue.Queue[Any]) -> None:
        while (item := lane.get()) is not None:
            due, marker, enqueue, done = item
            if marker is not None:
                marker.wait(10.0)
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                enqueue()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.errors.append(exc)
            done.set()


@pytest.fixture
def lagging(monkeypatch) -> Iterator[Callable[..., Any]]:
    """`lagging(make_rig, lag_s, **kwargs)`: a rig whose caches take the device path on a
    LaggingStream (returned with it)."""
    streams: list[LaggingStream] = []

    def make(make_rig: Callable[..., Any], lag_s: float, **kwargs: Any) -> tuple[Any, LaggingStream]:
        stream = LaggingStream(lag_s)
        streams.append(stream)
        with monkeypatch.context() as patch:
            patch.setattr(
                layerkv.connector.worker, "CacheViews", functools.partial(CacheViews, on_host=False, copies=stream)
            )
            rig = make_rig(**kwargs)
        assert rig.workers[0]._jobs.caches.views.copies is stream
        return rig, stream

    yield make
    for stream in streams:
        stream.close()
    assert not [e for s in streams for e in s.errors]


def _layer_wrong(rig: Any, req: Req, layer_idx: int, blocks: range) -> list[int]:
    return [
        i
        for i in blocks
        if not bool(
            (rig.block_values(0, layer_idx, req.block_ids[i]) == rig.expected_block(0, layer_idx, req.hashes[i])).all()
        )
    ]


@pytest.mark.parametrize("read_layers_per_range", [1, 2])
def test_a_loaded_layer_is_in_the_cache_when_wait_for_layer_load_returns(
    make_rig, lagging, read_layers_per_range
) -> None:
    producer = make_rig(num_layers=4, transfer_plan="groups")
    tokens = block_tokens(4, BLOCK_SIZE)
    producer.run(Req("p", tokens))
    rig, stream = lagging(
        make_rig,
        0.05,
        num_layers=4,
        role=KVRole.CONSUMER,
        transfer_plan="groups",
        read_layers_per_range=read_layers_per_range,
    )
    a = Req("a", list(tokens))
    ext, s = rig.admit(a)
    assert ext == 4 * BLOCK_SIZE
    rig.poison(a)
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    for layer_idx in range(4):
        worker.wait_for_layer_load(rig.layer_name(layer_idx))
        assert _layer_wrong(rig, a, layer_idx, range(4)) == []  # read by compute right now
    assert stream.compute_waits >= 2
    assert rig.end_step([s]) == set()


def test_a_saved_layer_is_written_after_its_copy_landed(make_rig, lagging) -> None:
    rig, _ = lagging(make_rig, 0.05, num_layers=3, transfer_plan="groups")
    tokens = block_tokens(3, BLOCK_SIZE)
    rig.run(Req("p", tokens))
    consumer = make_rig(num_layers=3, role=KVRole.CONSUMER, transfer_plan="groups")
    a = Req("a", list(tokens))
    ext, s = consumer.admit(a)
    assert ext == 3 * BLOCK_SIZE
    consumer.poison(a)
    assert consumer.step([s]) == set() and consumer.wrong_blocks(a, range(3)) == []


def test_a_load_that_gave_up_lets_no_queued_copy_land_afterwards(make_rig, backend, lagging) -> None:
    producer = make_rig(num_layers=2, transfer_plan="groups")
    tokens = block_tokens(6, BLOCK_SIZE)
    producer.run(Req("p", tokens))
    object_nbytes = producer.workers[0].layout.object_nbytes
    # 2 staging slots for loads: the 6 keys of layer 0 pass in 3 waves; the last one stalls
    rig, stream = lagging(
        make_rig,
        0.3,
        num_layers=2,
        role=KVRole.CONSUMER,
        transfer_plan="groups",
        staging_nbytes=4 * 2 * object_nbytes,
        load_timeout_s=0.2,
    )
    a = Req("a", list(tokens))
    _, s = rig.admit(a)
    stalled = rig.keys(a)[4]
    rig.faults[0].delay(GET_RANGES, 1.5, keys=stalled, times=1)
    worker = rig.workers[0]
    worker.bind_connector_metadata(rig.scheduler.build_connector_meta(rig.step_of([s])))
    worker.start_load_kv()
    worker.wait_for_layer_load(rig.layer_name(0))  # gives up at 0.2 s: waves 1 and 2 are queued, not landed
    for cache in rig.caches[0].values():  # the engine reuses the blocks at once
        cache[:, a.block_ids[:6]] = -7.0
    time.sleep(0.8)  # past every queued copy
    values = (rig.block_values(0, li, a.block_ids[i]).flatten() for li in range(2) for i in range(6))
    assert {float(v) for block in values for v in block} == {-7.0}
    assert rig.end_step([s]) == set(a.block_ids[:6])
    rig.faults[0].release()
    assert worker.is_idle(5.0)
