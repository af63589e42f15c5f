"""Verdict semantics: ``healthy`` only when nothing was found, ``inconclusive`` for suspects or too little data.

The invariant checked over every recorded fixture and over synthetic findings: the verdict is never
``healthy`` while any finding has confidence >= 0.3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import Finding
from diag.rules.engine import PRIMARY_CONFIDENCE, SUSPECT_CONFIDENCE, analyze, verdict
from diag.timeline import timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ALL_FIXTURES = sorted(FIXTURES.glob("scenarios/*.jsonl.gz")) + sorted(FIXTURES.glob("uninstrumented/*.jsonl.gz"))


def _finding(cls: str, confidence: float) -> Finding:
    return Finding(cls=cls, rule=f"test.{cls}", confidence=confidence, summary=f"{cls} at {confidence}")


def test_strong_finding_names_the_class() -> None:
    found = [_finding("memory_leak", 0.9), _finding("host_oom", 0.6), _finding("thrashing", 0.35)]
    primary, contributing, suspects = verdict(found, [])
    assert primary == "memory_leak" and contributing == ["host_oom"]
    assert [s["class"] for s in suspects] == ["thrashing"]


def test_suspects_only_is_inconclusive_with_their_confidence() -> None:
    primary, contributing, suspects = verdict([_finding("thrashing", 0.45), _finding("memory_pressure", 0.3)], [])
    assert primary == "inconclusive" and contributing == []
    assert [(s["class"], s["confidence"]) for s in suspects] == [("thrashing", 0.45), ("memory_pressure", 0.3)]


def test_too_little_data_is_inconclusive_not_healthy() -> None:
    short = [{"rule": "memory.leak", "class": "memory_leak", "have": "7 s", "needed": "30 s"}]
    assert verdict([], short)[0] == "inconclusive"
    assert verdict([_finding("thrashing", 0.2)], [])[0] == "healthy"  # a note below 0.3 is not a suspect
    assert verdict([], [])[0] == "healthy"


@pytest.mark.parametrize("confidence", [0.0, 0.29, 0.3, 0.31, 0.49, 0.5, 0.99])
def test_never_healthy_with_a_finding_at_or_above_the_suspect_level(confidence: float) -> None:
    primary, _, _ = verdict([_finding("noisy_neighbour", confidence)], [])
    if confidence >= PRIMARY_CONFIDENCE:
        assert primary == "noisy_neighbour"
    elif confidence >= SUSPECT_CONFIDENCE:
        assert primary == "inconclusive"
    else:
        assert primary == "healthy"


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: p.name)
def test_fixtures_keep_the_invariant(path: Path) -> None:
    analysis = analyze(timeline_from_records(read_jsonl_gz(path), source=path.name))
    strong = [f for f in analysis.findings if f.confidence >= SUSPECT_CONFIDENCE]
    if strong:
        assert analysis.primary != "healthy", [(f.cls, f.confidence) for f in strong]
    doc = analysis.to_dict()
    assert doc["verdict"]["primary"] == analysis.primary
    assert {"suspects", "too_little_data", "meaning"} <= set(doc["verdict"])
    for f in doc["findings"]:  # the engine stamped every finding with its class and rule
        assert f["class"] and f["rule"]
