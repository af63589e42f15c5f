"""Run every registered rule over a Timeline and rank the findings into one verdict.

Ranking: the primary cause is the most confident finding, with ties broken by how causal the class
is (a leak or four model copies *explain* an OOM kill; the OOM kill is the symptom) -- see
``CAUSAL_WEIGHT``. Findings below ``MIN_CONFIDENCE`` are kept in the list but cannot be the verdict.
No finding above it means ``healthy`` -- but only for the rules that could be evaluated, which the
``not_evaluated`` list makes explicit.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from diag.rules.base import RULES, Finding
from diag.timeline import Timeline

MIN_CONFIDENCE = 0.5
# Higher = more of a root cause. Symptoms (OOM kills) rank below what explains them when confidence ties.
CAUSAL_WEIGHT: dict[str, float] = {
    "memory_leak": 1.0,
    "duplicate_model_processes": 1.0,
    "blocking_loader_refresh": 1.0,
    "allocator_fragmentation": 1.0,
    "moe_expert_skew": 0.95,
    "request_count_batching": 0.95,
    "oversized_context": 0.95,
    "noisy_neighbour": 0.95,
    "thrashing": 0.9,
    "queue_backlog": 0.9,
    "memory_pressure": 0.85,
    "host_oom": 0.8,
    "gpu_oom": 0.8,
    "unsafe_config": 0.5,
}


@dataclass
class Analysis:
    primary: str
    contributing: list[str]
    findings: list[Finding]
    not_evaluated: list[dict[str, Any]]
    window: tuple[float, float]
    source: str = ""
    evaluated: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The documented ``diag analyze --json`` document."""
        return {
            "verdict": {"primary": self.primary, "contributing": self.contributing},
            "findings": [f.to_dict() for f in self.findings],
            "not_evaluated": self.not_evaluated,
            "evaluated": self.evaluated,
            "window": {"start": self.window[0], "end": self.window[1]},
            "source": self.source,
        }


def load_rules() -> None:
    """Import every module in diag.rules so their @rule decorators register."""
    import diag.rules as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "engine"):
            importlib.import_module(f"diag.rules.{info.name}")


def _score(f: Finding) -> float:
    return f.confidence * (0.9 + 0.1 * CAUSAL_WEIGHT.get(f.cls, 0.5))


def analyze(timeline: Timeline) -> Analysis:
    load_rules()
    signals = timeline.signals()
    findings: list[Finding] = []
    not_evaluated: list[dict[str, Any]] = []
    evaluated: list[str] = []
    for rule_id, r in sorted(RULES.items()):
        lacking = r.missing(signals)
        if lacking:
            not_evaluated.append({"rule": rule_id, "class": r.cls, "missing": lacking})
            continue
        try:
            finding = r.fn(timeline)
        except Exception as exc:  # a broken rule must not hide the others' verdicts
            not_evaluated.append({"rule": rule_id, "class": r.cls, "missing": [f"rule error: {type(exc).__name__}: {exc}"]})
            continue
        evaluated.append(rule_id)
        if finding is not None:
            findings.append(finding)
    findings.sort(key=_score, reverse=True)
    strong = [f for f in findings if f.confidence >= MIN_CONFIDENCE]
    primary = strong[0].cls if strong else "healthy"
    contributing = []
    for f in strong[1:]:
        if f.cls != primary and f.cls not in contributing:
            contributing.append(f.cls)
    return Analysis(primary, contributing, findings, not_evaluated, (timeline.start, timeline.end), timeline.source, evaluated)
