"""The public surface of `import layerkv` is pinned: changing it is a decision, not an accident."""

from __future__ import annotations

import layerkv

PUBLIC = ["ConfigError", "LayerKVConfig", "LayerKVError", "LayoutError", "StoreError", "__version__"]


def test_public_names_are_pinned() -> None:
    assert sorted(layerkv.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(layerkv, name) is not None
    assert issubclass(layerkv.ConfigError, layerkv.LayerKVError) and issubclass(layerkv.ConfigError, ValueError)


def test_import_needs_neither_torch_nor_vllm_nor_mooncake() -> None:
    import subprocess
    import sys

    code = (
        "import sys, layerkv, layerkv.config; "
        "print(sorted(m for m in ('torch', 'vllm', 'mooncake') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


VLLM_PUBLIC = ["LayerKVConnector", "LayerKVMetadata", "LayerKVStats"]


def test_the_vllm_module_path_names_the_connector_and_imports_no_vllm() -> None:
    """What users write: `kv_connector_module_path: layerkv.integrations.vllm` and `kv_connector:
    LayerKVConnector` (vLLM imports the path, then getattr). Importing the package, or its plugin
    (which vLLM loads in every process), loads no vllm; the connector's names load on access."""
    import subprocess
    import sys

    code = (
        "import sys, layerkv.integrations.vllm as p, layerkv.integrations.vllm.plugin; "
        "print(sorted(p.__all__), sorted(m for m in ('vllm', 'torch', 'layerkv.integrations.vllm.connector') "
        "if m in sys.modules), hasattr(p, 'OPEN_STORE'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == f"{sorted(VLLM_PUBLIC)} [] False"
