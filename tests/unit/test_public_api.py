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
