"""vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): makes the name
`LayerKVConnector` known to vLLM's connector registry in every vLLM process (API server,
engine core, workers), before any connector exists. vLLM's `MultiConnector` looks its
children's stats classes up by that name (`KVConnectorFactory.get_connector_class_by_name`)
in the front-end process, which never imports layerkv otherwise. Imports only vLLM's factory
(the connector module itself loads lazily: the package `__init__` imports no vllm); safe to
call any number of times.
"""

from __future__ import annotations

CONNECTOR_NAME = "LayerKVConnector"
CONNECTOR_MODULE = "layerkv.integrations.vllm"


def register() -> None:
    """Register `LayerKVConnector` with `KVConnectorFactory` (a no-op when it is already
    registered or vLLM is not installed). An unsupported vLLM version is not an error here:
    it is reported when a connector is created (importing `layerkv.integrations.vllm.connector`)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # "Connector 'LayerKVConnector' is already registered."
        pass
