"""layerkv's vLLM general plugin, as vLLM loads it: in a fresh process of this venv, vLLM's own
plugin loader registers `LayerKVConnector` with the connector registry without importing the
connector module (what MultiConnector's front end needs to rebuild layerkv's stats by name). The
probe sees this test's PYTHONPATH, so it loads the checkout under test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

PROBE = """
import sys
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
assert "LayerKVConnector" not in KVConnectorFactory._registry
load_general_plugins()
assert "layerkv.integrations.vllm.connector" not in sys.modules, "the plugin must not import the connector"
cls = KVConnectorFactory.get_connector_class_by_name("LayerKVConnector")
print(cls.__module__, cls.__name__)
"""


def test_vllm_plugin_loader_registers_the_connector_name():
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=240,
        env={
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "layerkv.integrations.vllm.connector LayerKVConnector"
