"""Run every registered rule over a Timeline and rank the findings into one verdict.

Verdict semantics (documented in ``diag analyze --help``, the README and the JSON document):

Every rule runs once; then the precedence table (``diag.rules.precedence``) steps down the findings
that give way to another rule's (pressure under a firm OOM kill of the service's own, pressure under
stall-only thrashing with page-ins); then findings are ranked.

- a class name: the most confident finding at or above ``PRIMARY_CONFIDENCE`` (0.5), ties broken by
  how causal the class is (a leak or four model copies *explain* an OOM kill; the OOM kill is the
  symptom -- see ``diag.rules.classes``); other such findings are ``contributing``;
- ``inconclusive``: no finding reached 0.5, but at least one reached ``SUSPECT_CONFIDENCE`` (0.3) --
  sustained evidence that is not firm enough to name the cause; the ``suspects`` list names them
  with their confidence -- or a rule could not judge because the window held too little data
  (``too_little_data``: what the rule had and what it needs);
- ``healthy``: no rule found anything at 0.3 or more and every rule that could be evaluated had
  enough data. Findings below 0.3 stay listed as notes (what a rule looked at and found weak); they
  never make the verdict. Rules whose signals are absent are listed in ``not_evaluated``: ``healthy``
  only speaks for the rules that ran.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from diag.rules.base import RULES, Finding, TooLittleData
from diag.rules.classes import CAUSAL_WEIGHT, HEALTHY, INCONCLUSIVE
from diag.rules.context import AnalysisContext
from diag.rules.precedence import apply_precedence
from diag.timeline import Timeline
from diag.timeline.builder import TRIM_FROM_ROWS
from diag.timeline.columns import give_back_freed_memory

PRIMARY_CONFIDENCE = 0.5
SUSPECT_CONFIDENCE = 0.3
MIN_CONFIDENCE = PRIMARY_CONFIDENCE  # the older name, kept for callers


@dataclass
class Analysis:
    primary: str  # a class name, "inconclusive" or "healthy"
    contributing: list[str]
    findings: list[Finding]
    not_evaluated: list[dict[str, Any]]
    window: tuple[float, float]
    source: str = ""
    evaluated: list[str] = field(default_factory=list)
    suspects: list[dict[str, Any]] = field(default_factory=list)  # findings in [0.3, 0.5) when inconclusive
    too_little_data: list[dict[str, Any]] = field(default_factory=list)  # rules that could not judge this window

    @property
    def verdict(self) -> str:
        return self.primary

    def to_dict(self) -> dict[str, Any]:
        """The documented ``diag analyze --json`` document."""
        return {
            "verdict": {
                "primary": self.primary,
                "contributing": self.contributing,
                "suspects": self.suspects,
                "too_little_data": self.too_little_data,
                "meaning": VERDICT_MEANING,
            },
            "findings": [f.to_dict() for f in self.findings],
            "not_evaluated": self.not_evaluated,
            "evaluated": self.evaluated,
            "window": {"start": self.window[0], "end": self.window[1]},
            "source": self.source,
        }


VERDICT_MEANING = (
    f"primary is an incident class when a finding reached confidence {PRIMARY_CONFIDENCE}; 'inconclusive' when "
    f"findings reached only {SUSPECT_CONFIDENCE} (see suspects) or a rule had too little data (see too_little_data); "
    f"'healthy' only when no rule found anything at {SUSPECT_CONFIDENCE} or more and none lacked data"
)


def load_rules() -> None:
    """Import every module in diag.rules so their @rule decorators register."""
    import diag.rules as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "engine"):
            importlib.import_module(f"diag.rules.{info.name}")


def _score(f: Finding) -> float:
    return f.confidence * (0.9 + 0.1 * CAUSAL_WEIGHT.get(f.cls, 0.5))


def verdict(findings: list[Finding], too_little: list[dict[str, Any]]) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(primary, contributing, suspects) from findings already sorted by ``_score``."""
    strong = [f for f in findings if f.confidence >= PRIMARY_CONFIDENCE]
    suspects = [
        {"class": f.cls, "rule": f.rule, "confidence": round(f.confidence, 3), "summary": f.summary}
        for f in findings
        if SUSPECT_CONFIDENCE <= f.confidence < PRIMARY_CONFIDENCE
    ]
    if strong:
        primary = strong[0].cls
    elif suspects or too_little:
        primary = INCONCLUSIVE
    else:
        primary = HEALTHY
    contributing: list[str] = []
    for f in strong[1:]:
        if f.cls != primary and f.cls not in contributing:
            contributing.append(f.cls)
    return primary, contributing, suspects


def analyze(timeline: Timeline) -> Analysis:
    load_rules()
    signals = timeline.signals()
    ctx = AnalysisContext(timeline)  # per-analysis memo: rules share passes over this timeline, nothing outlives it
    by_rule: dict[str, Finding] = {}
    not_evaluated: list[dict[str, Any]] = []
    evaluated: list[str] = []
    too_little: list[dict[str, Any]] = []
    # A day's rules free tens of MiB of temporaries each; handed back between rules, the next one's are mapped afresh
    # instead of stacking on pages glibc kept (the analysis's peak over a day: measured in bench/analyze.py).
    large = sum(timeline.counts.values()) >= TRIM_FROM_ROWS
    for rule_id, r in sorted(RULES.items()):
        lacking = r.missing(signals)
        if lacking:
            not_evaluated.append({"rule": rule_id, "class": r.cls, "missing": lacking, "why": r.explain(lacking)})
            continue
        try:
            result = r.fn(timeline, ctx)
        except Exception as exc:  # a broken rule must not hide the others' verdicts
            not_evaluated.append({"rule": rule_id, "class": r.cls, "missing": [f"rule error: {type(exc).__name__}: {exc}"]})
            continue
        finally:
            if large:
                give_back_freed_memory()
        evaluated.append(rule_id)
        if isinstance(result, TooLittleData):
            too_little.append({"rule": rule_id, "class": r.cls, **result.to_dict()})
        elif result is not None:
            result.rule = result.rule or rule_id
            result.cls = result.cls or r.cls
            by_rule[rule_id] = result
    apply_precedence(by_rule)
    findings = sorted(by_rule.values(), key=_score, reverse=True)
    primary, contributing, suspects = verdict(findings, too_little)
    return Analysis(
        primary,
        contributing,
        findings,
        not_evaluated,
        (timeline.start, timeline.end),
        timeline.source,
        evaluated,
        suspects,
        too_little,
    )
