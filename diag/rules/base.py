"""What a rule is and what it returns.

A rule is a pure function ``Timeline -> Finding | None``, registered with an id, the incident class
it can conclude, and the signals it needs. The engine checks the signals first: a rule whose
signals are absent is reported *not evaluated* (with what was missing), never *healthy* -- an
on-call engineer must be able to tell "no problem found" from "could not look".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from diag.rules.classes import INCIDENT_CLASSES
from diag.timeline import signals

__all__ = ["INCIDENT_CLASSES", "RULES", "Evidence", "Finding", "Rule", "TooLittleData", "rule"]


@dataclass
class Evidence:
    """One number that convinced the rule, with its unit and the time range it covers.

    ``series`` optionally carries a short excerpt ``[[ts, value], ...]`` (at most ~50 points) for
    reports to draw; keep it small -- the full series lives in the timeline.
    """

    what: str
    value: float | int | str | None
    unit: str = ""
    start: float | None = None
    end: float | None = None
    series: list[list[float]] | None = None


@dataclass
class Finding:
    cls: str  # the engine stamps the registered rule's class when a rule leaves it empty
    rule: str  # the engine stamps the rule id when empty
    confidence: float  # 0..1: how sure the rule is that this class applies
    summary: str  # one sentence in the operator's words, with the key number
    evidence: list[Evidence] = field(default_factory=list)
    rules_out: list[str] = field(default_factory=list)  # classes/explanations this evidence excludes, with why
    remediation: list[str] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    # Classes this finding already gave way to on its own evidence (a pressure rule that saw thrashing-level
    # stalls itself): the engine's precedence table does not step it down for them again. Not in the document.
    yielded_to: set[str] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cls and self.cls not in INCIDENT_CLASSES:
            raise ValueError(f"unknown incident class {self.cls!r}")
        self.confidence = max(0.0, min(1.0, float(self.confidence)))

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["class"] = body.pop("cls")
        del body["yielded_to"]
        return body


@dataclass
class TooLittleData:
    """A rule's answer when the window is too short for it to judge: what it had and what it needs.

    Why not ``None``: ``None`` means "looked and found nothing"; a 7-second bundle cannot show a leak,
    and saying ``healthy`` about it would be a lie. The engine turns this into an ``inconclusive``
    verdict (unless another rule found the cause) with the amount needed.
    """

    have: str  # e.g. "12 s of memory samples"
    needed: str  # e.g. "30 s and 20 samples"

    def to_dict(self) -> dict[str, str]:
        return {"have": self.have, "needed": self.needed}


RuleFn = Callable[..., "Finding | TooLittleData | None"]


@dataclass(frozen=True)
class Rule:
    id: str
    cls: str
    needs: tuple[str, ...]  # every one of these signals must be present (Timeline.signals() names)
    needs_any: tuple[str, ...]  # at least one of these must be present (empty: no such requirement)
    fn: RuleFn
    doc: str

    def explain(self, lacking: list[str]) -> list[str]:
        """Each lacking signal (or ``a or b`` group) with where it would come from."""
        return [" or ".join(signals.where_from(s) for s in item.split(" or ")) for item in lacking]

    def missing(self, signals: set[str]) -> list[str]:
        """What this rule lacks to be evaluated on a timeline with these signals."""
        lacking = [s for s in self.needs if not _present(s, signals)]
        if self.needs_any and not any(_present(s, signals) for s in self.needs_any):
            lacking.append(" or ".join(self.needs_any))
        return lacking


def _present(signal: str, signals: set[str]) -> bool:
    """``cgroup:psi.memory.*`` style prefixes match any signal that starts with the part before ``*``."""
    if signal.endswith("*"):
        prefix = signal[:-1]
        return any(s.startswith(prefix) for s in signals)
    return signal in signals


RULES: dict[str, Rule] = {}


def rule(rule_id: str, cls: str, *, needs: tuple[str, ...] = (), needs_any: tuple[str, ...] = ()) -> Callable[[RuleFn], RuleFn]:
    """Register a rule. ``needs``/``needs_any`` name signals as ``Timeline.signals()`` does."""
    if cls not in INCIDENT_CLASSES:
        raise ValueError(f"rule {rule_id}: unknown class {cls!r}")
    unknown = [s for s in (*needs, *needs_any) if not signals.known(s)]
    if unknown:
        raise ValueError(f"rule {rule_id}: signals the vocabulary (diag/timeline/signals.py) does not know: {unknown}")

    def register(fn: RuleFn) -> RuleFn:
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id} registered twice")
        RULES[rule_id] = Rule(rule_id, cls, needs, needs_any, fn, (fn.__doc__ or "").strip())
        return fn

    return register
