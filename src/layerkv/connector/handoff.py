"""Which layers of a step's save the compute thread has handed to the save job, and when. A
layer is handed once every one of its registered caches was saved (save_kv_layer per cache
name), or once the compute moved past it; each hand-off carries the compute stream's marker
(transfer/device.py), so a device copy starts after the layer's compute. A step whose per-layer
hooks never ran (vLLM replayed it as one CUDA graph: connector/graphs.py) hands every layer at
the end of the forward, with a marker recorded then. Compute thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class SaveHandoff:
    def __init__(self) -> None:
        self._names_per_layer: Sequence[int] = ()
        self._job: Any = None  # this step's SaveJob (hand_layer(layer_idx, marker)); None: nothing to hand
        self._marker: Callable[[], Any] = lambda: None
        self._saved: dict[int, int] = {}  # layer -> cache names saved this step
        self._handed: set[int] = set()
        self._unhanded: set[int] = set()  # saved this step, not handed yet

    def start(self, job: Any, names_per_layer: Sequence[int], marker: Callable[[], Any]) -> None:
        """A new step: `job` (None: this step saves nothing) takes the layers handed from now."""
        self._job, self._names_per_layer, self._marker = job, names_per_layer, marker
        self._saved, self._handed, self._unhanded = {}, set(), set()

    @property
    def pending(self) -> bool:
        """Layers saved and not handed yet (a per-layer hook has work)."""
        return bool(self._unhanded)

    @property
    def hooked(self) -> bool:
        """Did any save_kv_layer of this step reach here?"""
        return bool(self._saved)

    def saved(self, layer_idx: int) -> None:
        """save_kv_layer for one of the layer's caches: handed once all of them were saved."""
        self.passed(layer_idx)
        self._saved[layer_idx] = self._saved.get(layer_idx, 0) + 1
        self._unhanded.add(layer_idx)
        if self._saved[layer_idx] >= self._names_per_layer[layer_idx]:
            self._hand(layer_idx)

    def passed(self, layer_idx: int) -> None:
        """The compute reached `layer_idx`: the layers before it that were saved are complete."""
        if self._unhanded:
            for earlier in sorted(li for li in self._unhanded if li < layer_idx):
                self._hand(earlier)

    def finish(self, num_layers: int) -> bool:
        """The forward ended: hand what was saved; with no save_kv_layer at all in the step (a
        graph replay), every layer, from the cache as it is now. True for the latter."""
        if self._job is None:
            return False
        replayed = not self._saved
        if replayed:
            self._saved = {layer: self._names_per_layer[layer] for layer in range(num_layers)}
            self._unhanded = set(range(num_layers))
        self.passed(num_layers)
        return replayed

    def _hand(self, layer_idx: int) -> None:
        if self._job is None or layer_idx in self._handed or layer_idx not in self._saved:
            return
        self._handed.add(layer_idx)
        self._unhanded.discard(layer_idx)
        self._job.hand_layer(layer_idx, self._marker())
