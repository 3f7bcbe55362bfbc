"""The test side of FaultyLayerKVConnector's file protocol (see faulty_connector.py): arm faults
in an engine's workers and read what each worker reported after its last step. Test thread only;
files are replaced atomically, so a worker never reads half of one.
"""

from __future__ import annotations

import json
from pathlib import Path


def arm(fault_dir: Path, seq: int, rules: list[dict], marker: str | None = None) -> None:
    """Steer FaultyLayerKVConnector in the engine's workers (applied at their next loading step)."""
    tmp = fault_dir / ".control.json"
    tmp.write_text(json.dumps({"seq": seq, "rules": rules, "marker": marker}))
    tmp.replace(fault_dir / "control.json")


def worker_state(fault_dir: Path, rank: int = 0) -> dict:
    """What worker `rank` wrote after its last step."""
    return json.loads((fault_dir / f"state-rank{rank}.json").read_text())
