"""The exception tree of layerkv. Pure definitions, no side, no threads.

    LayerKVError
    ├── ConfigError          bad key / type / range in the config (startup)
    ├── UnsupportedSetupError  a deployment shape layerkv does not support yet (startup)
    │   └── EngineVersionError  the installed engine (vLLM) is outside the supported versions
    ├── LayoutError          registered KV caches whose layout layerkv cannot describe
    ├── HeaderError          an object header that does not match this deployment
    ├── StoreError           a backend failed to start or a call could not be made at all
    │   ├── StoreVersionError  the backend lacks required methods / is too old
    │   └── PortInUseError     a local server's port is held by another process
    └── TransferError        a layer's transfer failed in a way the engine must see
        └── TransferTimeout  a wait for a layer exceeded its timeout

A cache miss is a value (a result code), never an exception.
"""

from __future__ import annotations


class LayerKVError(Exception):
    """Base of every error layerkv raises on purpose."""


class ConfigError(LayerKVError, ValueError):
    """A config key is unknown, of the wrong type or out of range. The message names the key."""


class UnsupportedSetupError(LayerKVError):
    """The engine setup (context parallel, hybrid groups, ...) is not supported."""


class EngineVersionError(UnsupportedSetupError, ImportError):
    """The installed engine's version is outside the range layerkv supports (raised at import
    of the engine's integration module). The message names both versions and the fix."""


class LayoutError(LayerKVError, ValueError):
    """A registered KV cache has a shape/stride layerkv cannot map to object ranges."""


class HeaderError(LayerKVError):
    """An object header does not match (magic, schema, namespace, layout, block, size)."""


class StoreError(LayerKVError):
    """A store backend could not be set up or called."""


class StoreVersionError(StoreError):
    """The store client lacks required methods or is older than the minimum version."""


class PortInUseError(StoreError):
    """A port a locally started server must own (e.g. mooncake_master's RPC or HTTP port) is
    held by another process. `port` is the port; the message names its holder when visible."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


class TransferError(LayerKVError):
    """A layerwise transfer failed and the compute thread must not use the layer."""


class TransferTimeout(TransferError, TimeoutError):
    """Waiting for a layer's transfer exceeded its timeout."""
