"""One line of `layerkv doctor`'s report: a check's name, whether it passed, and why (shared by
the store checks in doctor.py and the device check in doctor_device.py). Main thread only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name:<22} {self.detail}"
