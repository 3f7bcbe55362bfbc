"""Questions tests ask of a CacheLayout that the library itself never needs: whether a group of
layers is one byte run per block (a cross-layer cache), and the merged segments of a group."""

from __future__ import annotations

from layerkv.errors import LayoutError
from layerkv.objects.layout import CacheLayout
from layerkv.objects.ranges import SegmentTemplate, merge_segments


def layer_group_template(layout: CacheLayout, first_layer: int, num_layers: int) -> SegmentTemplate:
    """Segments of layers [first_layer, first_layer + num_layers) together, merged where they
    are adjacent both locally and in the object (a cross-layer cache, vLLM's BLHNC / BLNHC: one
    segment per block)."""
    if num_layers < 1 or first_layer < 0 or first_layer + num_layers > layout.num_layers:
        raise LayoutError(
            f"layer group [{first_layer}, {first_layer + num_layers}) is not within the {layout.num_layers} layers"
        )
    segments = [e.segment for layer in layout.layers[first_layer : first_layer + num_layers] for e in layer]
    return SegmentTemplate.build(segments, layout.num_blocks, layout.max_transfer_bytes)


def layers_adjacent(layout: CacheLayout, first_layer: int, num_layers: int) -> bool:
    """Layers [first_layer, first_layer + num_layers) of every block are one local byte run in
    object order (before any max_transfer_bytes split)."""
    segments = [e.segment for layer in layout.layers[first_layer : first_layer + num_layers] for e in layer]
    return len(segments) > 0 and len(merge_segments(segments)) == 1
