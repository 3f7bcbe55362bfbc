"""`layerkv doctor --device` / `layerkv demo --device` name a device that is not there instead of
raising: a CUDA index past the devices torch sees, or one that is not an index (torch's device
queries faked: this machine has no CUDA device; tests/gpu runs the real round trip)."""

from __future__ import annotations

import pytest
import torch

from layerkv.commands.doctor_device import check_device, unavailable


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_index_past_the_devices_is_named(two_gpus: None) -> None:
    assert unavailable("cuda") is None and unavailable("cuda:0") is None and unavailable("cuda:1") is None
    assert unavailable("cuda:2") == "--device cuda:2: torch sees 2 CUDA devices (cuda:0..cuda:1)"
    assert unavailable("cuda:x") == "--device cuda:x: the CUDA device is cuda or cuda:N (N a device index)"
    result = check_device("cuda:7", None)  # a FAIL line, not a traceback
    assert not result.ok and result.detail == "--device cuda:7: torch sees 2 CUDA devices (cuda:0..cuda:1)"
