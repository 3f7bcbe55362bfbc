"""Layer groups: the layers a transfer moves as ONE range per key, and the contiguous object
span they cover. Pure values, computed from the layout; any thread.

    object:   | header | L0 | L1 | L2 | L3 | L4 | ...      groups (k=2): [0,1) [1,3) [3,5) ...

Layer 0 is a group of its own (compute can start on it early) and carries the header.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers [first_layer, end_layer) read together: object bytes [span_start, span_start +
    span_nbytes). The group of layer 0 starts at 0 (the header travels with it)."""

    first_layer: int
    end_layer: int
    span_start: int
    span_nbytes: int

    @property
    def label(self) -> str:
        last = self.end_layer - 1
        return f"layer {self.first_layer}" if last == self.first_layer else f"layers {self.first_layer}..{last}"


def layer_groups(layout: CacheLayout, layers_per_range: int) -> tuple[LayerGroup, ...]:
    """Layer 0 alone (compute can start early), then groups of `layers_per_range` layers; the
    last group holds what is left."""
    if layers_per_range < 1:
        raise LayoutError(f"layers_per_range={layers_per_range} must be >= 1")
    n = layout.num_layers
    bounds = [0, *range(1, n, layers_per_range), n] if n > 1 else [0, 1]
    return groups_of(layout, tuple(bounds[1:]))


def groups_of(layout: CacheLayout, group_ends: tuple[int, ...]) -> tuple[LayerGroup, ...]:
    """The groups [0, e0), [e0, e1), ... (exclusive ends); the first one includes the header."""
    groups, first = [], 0
    for end in group_ends:
        start = 0 if first == 0 else layout.layer_offset(first)
        stop = layout.layer_offset(end - 1) + layout.layer_nbytes(end - 1)
        groups.append(LayerGroup(first, end, start, stop - start))
        first = end
    return tuple(groups)
