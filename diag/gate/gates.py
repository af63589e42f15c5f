"""The two gates before the load -- infrastructure and application -- as lists of checks, each PASS, FAIL, WARN
or NOT AVAILABLE with the value it read.

Why four states and not two: most of what a host says about its memory (cgroup v1, no per-group PSI, no limit)
is a fact to report, not a defect to fail on; only what the spec requires turns into FAIL. WARN is "worth a
look", NOT AVAILABLE is "could not be read here, and why" -- never silently a PASS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

State = Literal["PASS", "FAIL", "WARN", "NOT AVAILABLE"]
STATES: tuple[State, ...] = ("PASS", "FAIL", "WARN", "NOT AVAILABLE")


@dataclass(frozen=True)
class Check:
    """One check: ``value`` is what was read (in the reader's words), ``detail`` why this state."""

    name: str
    state: State
    value: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "state": self.state, "value": self.value, "detail": self.detail}


@dataclass
class GateResult:
    """One gate's checks in the order they ran; it passes when none of them FAILed."""

    name: str
    checks: list[Check] = field(default_factory=list)
    stopped: str = ""  # why the run stopped at this gate (the load was not sent), else ""

    @property
    def passed(self) -> bool:
        return not any(c.state == "FAIL" for c in self.checks)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "stopped": self.stopped or None,
            "checks": [c.to_dict() for c in self.checks],
        }
