"""layerkv: a layerwise KV-cache pool for LLM inference engines.

Each KV block is one object per storage rank holding all layers; every layer's byte ranges are
written right after that layer runs and read ahead of the layer that needs them. Importing this
package needs neither vllm nor mooncake.
"""

from __future__ import annotations

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError, LayerKVError, LayoutError, StoreError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LayerKVConfig", "LayerKVError", "LayoutError", "StoreError", "__version__"]
