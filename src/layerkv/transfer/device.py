"""Ordering of the copies between a device KV cache and host staging: the one place layerkv
touches streams and events. Every device copy runs on a side stream (one for saves, one for
loads: a load's copy never queues behind a save's wait for compute, and the two directions
overlap), ordered by markers (device events), never by a wait of the whole device:

    compute stream:  attn l ─ marker(l) ─ attn l+1 ...      ... wait(ready) ─ attn m (reads m)
    save stream:          └ wait(marker l) ─ cache→pinned ─ done
    load stream:                                   wait(step) ─ pinned→cache ─ ready
    transfer thread:                          host_wait(done) ─ tags, store write

* a save's copy of layer l waits (on the side stream) for the marker the compute thread took
  when it handed l over, and the send thread waits for that copy alone (`host_wait`);
* a load's copies into the cache wait for the marker the compute thread took at the step's
  start (every earlier kernel that used those blocks is done), and `wait_for_layer_load` makes
  the compute stream wait for the copy's marker (`compute_wait`, no host synchronisation);
* a load that gives up makes the compute stream wait for every copy it queued: nothing it
  queued lands after the engine reuses the blocks; an `enqueue` that raises half-way is
  waited for before the error propagates (no copy it queued is left in flight untracked).

`HostCopies` (host caches, and device caches on an accelerator without streams here) runs each
copy as it is asked for and its markers are None; `StreamCopies` is the CUDA one; the tests
drive the ordering on CPU with an emulated lagging stream (tests/connector/test_device_order.py).
Pinned host buffers come from torch's caching host allocator, which keeps a buffer an
asynchronous copy still reads from being lent again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

Marker = Any  # a device event (None: nothing to wait for)


class DeviceCopies(Protocol):
    """How copies between host memory and a device cache are queued and waited for."""

    def compute_marker(self) -> Marker:
        """Compute thread: a marker after everything the compute stream queued so far."""

    def run_after(self, marker: Marker, enqueue: Callable[[], None], *, save: bool = False) -> Marker:
        """Transfer thread: run `enqueue` (it queues copies) on the side stream of loads (of
        saves: `save`) once `marker` is reached; returns the marker of its copies' completion.
        The copies of one stream complete in the order they were queued."""

    def host_wait(self, marker: Marker) -> None:
        """Transfer thread: block until `marker` is reached (only that copy, not the device)."""

    def compute_wait(self, marker: Marker) -> None:
        """Compute thread: later compute starts after `marker` (the host does not wait)."""

    def pinned(self, shape: tuple[int, int]) -> Any:
        """A uint8 host tensor the side stream copies from / into asynchronously."""

    def index(self, values: np.ndarray, device: Any) -> Any:
        """Inside `enqueue`: int64 `values` as an index tensor on `device` (queued, not waited for)."""


class HostCopies:
    """Copies run at once on the calling thread; every marker is None. `synchronize`: wait
    for the device after each copy (an accelerator with no stream support here)."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._synchronize = synchronize

    def compute_marker(self) -> Marker:
        return None

    def run_after(self, marker: Marker, enqueue: Callable[[], None], *, save: bool = False) -> Marker:
        enqueue()
        if self._synchronize is not None:
            self._synchronize()
        return None

    def host_wait(self, marker: Marker) -> None:
        return None

    def compute_wait(self, marker: Marker) -> None:
        return None

    def pinned(self, shape: tuple[int, int]) -> Any:
        import torch

        return torch.empty(shape, dtype=torch.uint8)

    def index(self, values: np.ndarray, device: Any) -> Any:
        import torch

        return torch.as_tensor(values, dtype=torch.int64, device=device)


class StreamCopies:
    """CUDA: a load stream and a save stream per worker (made on its device), events as
    markers; the transfer threads' events block (yield the CPU) rather than spin while they
    wait."""

    def __init__(self, device: Any) -> None:  # pragma: no cover - needs a GPU (tests/gpu)
        import torch

        self._torch = torch
        self._device = torch.device(device)
        self._loads = torch.cuda.Stream(device=self._device)
        self._saves = torch.cuda.Stream(device=self._device)

    def compute_marker(self) -> Marker:  # pragma: no cover - needs a GPU
        event = self._torch.cuda.Event(blocking=True)  # a transfer thread may host-wait on it
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def run_after(
        self, marker: Marker, enqueue: Callable[[], None], *, save: bool = False
    ) -> Marker:  # pragma: no cover - needs a GPU
        side = self._saves if save else self._loads
        with self._torch.cuda.device(self._device), self._torch.cuda.stream(side):  # a transfer thread's device is 0
            if marker is not None:
                side.wait_event(marker)
            try:
                enqueue()
            except BaseException:  # raised half-way: what it queued lands before the error leaves
                try:
                    landed = self._torch.cuda.Event(blocking=True)
                    landed.record(side)
                    landed.synchronize()
                except BaseException:  # noqa: BLE001 - a sticky CUDA error: the first error is the one to see
                    pass
                raise
            done = self._torch.cuda.Event(blocking=True)
            done.record(side)
        return done

    def host_wait(self, marker: Marker) -> None:  # pragma: no cover - needs a GPU
        if marker is not None:
            marker.synchronize()

    def compute_wait(self, marker: Marker) -> None:  # pragma: no cover - needs a GPU
        if marker is not None:
            self._torch.cuda.current_stream(self._device).wait_event(marker)

    def pinned(self, shape: tuple[int, int]) -> Any:  # pragma: no cover - needs a GPU
        return self._torch.empty(shape, dtype=self._torch.uint8, pin_memory=True)

    def index(self, values: np.ndarray, device: Any) -> Any:  # pragma: no cover - needs a GPU
        # from pinned memory: a pageable source would make the thread wait for the side stream
        host = self._torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).pin_memory()
        return host.to(device, non_blocking=True)


def copies_for(device: Any) -> DeviceCopies:
    """The copies of caches on `device` (a torch.device or its type name): CUDA streams and
    events; host copies elsewhere (other accelerators synchronise after each copy)."""
    device_type = getattr(device, "type", str(device))
    if device_type == "cpu":
        return HostCopies()
    if device_type == "cuda":  # pragma: no cover - needs a GPU
        return StreamCopies(device)
    import torch  # pragma: no cover - no other accelerator here

    return HostCopies(lambda: torch.accelerator.synchronize(torch.device(device)))  # pragma: no cover


def as_numpy(host: Any) -> np.ndarray:
    """The numpy view of a host tensor from `pinned` (no copy)."""
    return host.numpy()
