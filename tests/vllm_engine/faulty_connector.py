"""Test-only connector for the real engine: `FaultyLayerKVConnector` is layerkv's vLLM connector
over CheckedStore(FaultyStore(real store)), loaded by vLLM with
`"kv_connector": "FaultyLayerKVConnector", "kv_connector_module_path": "faulty_connector"`.

The test process steers it through files in $LAYERKV_TEST_FAULT_DIR (vLLM's workers are other
processes): `control.json` = {"seq": n, "rules": [{"rank": r | null, "kind": "fail" | "delay",
"layer_idx": l, "delay_s": s, "times": k}], "marker": name} is applied once per new `seq` at the
next step that loads; `marker` is then written once that step's loads are in flight. Each worker
writes `state-rank<r>.json` after every step ({"steps", "tracker_empty", "applied_seq"}).
The test side of that protocol: fault_control.py (no vLLM import in the test process).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import layerkv.integrations.vllm.sides as sides
from layerkv.integrations.vllm import LayerKVConnector
from layerkv.store.checked import CheckedStore
from layerkv.store.factory import open_store
from layerkv.store.faults import GET_RANGES, FaultyStore

_opened: list[FaultyStore] = []  # one per connector built in this process, in order


def _open_faulty_store(config: Any) -> CheckedStore:
    faulty = FaultyStore(open_store(config))
    _opened.append(faulty)
    return CheckedStore(
        faulty,
        max_batch_keys=config.max_transfer_blocks,
        retry_interval_s=config.store_retry_interval_s,
        call_timeout_s=config.store_call_timeout_s,
    )


sides.OPEN_STORE = _open_faulty_store  # this process's connectors (vLLM imports us in each)


class FaultyLayerKVConnector(LayerKVConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._test_faults = _opened[-1]
        self._test_dir = Path(os.environ["LAYERKV_TEST_FAULT_DIR"])
        self._test_applied_seq = 0
        self._test_steps = 0
        self._test_step_loads = False
        self._test_marker: str | None = None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._test_step_loads = bool(getattr(connector_metadata.payload, "loads", ()))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._test_step_loads:
            self._apply_control()
        super().start_load_kv(forward_context, **kwargs)
        if self._test_step_loads and self._test_marker:
            (self._test_dir / self._test_marker).write_text(str(self.deployment.tp_rank))
            self._test_marker = None

    def _apply_control(self) -> None:
        path = self._test_dir / "control.json"
        if not path.exists():
            return
        control = json.loads(path.read_text())
        if control["seq"] <= self._test_applied_seq:
            return
        self._test_applied_seq = control["seq"]
        for rule in control["rules"]:
            if rule.get("rank") not in (None, self.deployment.tp_rank):
                continue
            if rule["kind"] == "fail":
                self._test_faults.fail(GET_RANGES, None, layer_idx=rule.get("layer_idx"), times=rule.get("times", 1))
            elif rule["kind"] == "delay":
                self._test_faults.delay(
                    GET_RANGES, rule["delay_s"], None, layer_idx=rule.get("layer_idx"), times=rule.get("times", 1)
                )
            else:
                raise ValueError(f"unknown fault kind {rule['kind']!r}")
        self._test_marker = control.get("marker")

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._test_steps += 1
        state = {
            "steps": self._test_steps,
            "tracker_empty": self.worker_side.is_idle(1.0),  # type: ignore[attr-defined]
            "applied_seq": self._test_applied_seq,
        }
        tmp = self._test_dir / f".state-rank{self.deployment.tp_rank}.json"
        tmp.write_text(json.dumps(state))
        tmp.replace(self._test_dir / f"state-rank{self.deployment.tp_rank}.json")
