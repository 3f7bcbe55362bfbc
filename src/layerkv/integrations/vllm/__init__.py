"""layerkv's vLLM v1 connector, the module path users name:
  --kv-transfer-config '{"kv_connector": "LayerKVConnector",
    "kv_connector_module_path": "layerkv.integrations.vllm", ...}'
vLLM's KVConnectorFactory imports this package and takes `LayerKVConnector` from it by getattr.
The package's modules are the only importers of vllm: connector.py (the facade), sides.py (the store
and neutral sides it builds), setup.py (setup checks, Deployment), steps.py (step translation),
pools.py (several pools in one engine), metrics.py, events.py, version.py (the supported vLLMs) and
plugin.py (the general plugin that registers the connector's name).

Importing the package imports no vllm: the plugin, loaded in every vLLM process, lives here too and
must not load the connector (nor refuse an unsupported vLLM). The connector's names load on first
access (PEP 562); an unsupported vLLM raises `EngineVersionError` there. No state, no threads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerkv.integrations.vllm.connector import LayerKVConnector
    from layerkv.integrations.vllm.metrics import LayerKVStats
    from layerkv.integrations.vllm.steps import LayerKVMetadata

__all__ = ["LayerKVConnector", "LayerKVMetadata", "LayerKVStats"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.connector"), name)  # the facade re-exports them
