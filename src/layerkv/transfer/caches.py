"""The engine's KV caches as every transfer job sees them, fixed once at registration: their
layout (layers, segments, addresses, strides, device), the views over them (per-layer copies
and tags), the staged layers (group and whole-object images through staging) and the staging
areas whose slots are lent to jobs. Built on the compute thread; read-only afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layerkv.objects.layout import CacheLayout
from layerkv.transfer.staged import StagedLayers
from layerkv.transfer.staging import StagingAreas
from layerkv.transfer.views import CacheViews


@dataclass(frozen=True, slots=True)
class RegisteredCaches:
    layout: CacheLayout
    views: CacheViews
    staged: StagedLayers
    areas: StagingAreas

    @classmethod
    def over(cls, views: CacheViews, areas: StagingAreas) -> RegisteredCaches:
        return cls(views.layout, views, StagedLayers(views), areas)

    @property
    def on_host(self) -> bool:
        """Host caches are read and tagged by the host; device caches only through staging."""
        return self.views.on_host


@dataclass(frozen=True, slots=True)
class LentSlots:
    """Staging slots lent to one job (StagingArea.take / lend): `slots` of the area's `array`."""

    array: np.ndarray  # the area: uint8 [slots, width], registered with the store
    slots: np.ndarray  # int64: the slots this job holds
