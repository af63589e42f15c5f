"""The signal vocabulary: rules may only ask for known signals, and the Timeline names what it holds the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import RULES, rule
from diag.rules.engine import analyze, load_rules
from diag.timeline import signals, timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"


def test_a_misspelt_signal_fails_at_registration() -> None:
    with pytest.raises(ValueError, match=r"signals the vocabulary \(diag/timeline/signals\.py\) does not know"):
        rule("test.typo", "thrashing", needs=("cgroup:psi.memory.ful.avg10",))(lambda tl, ac=None: None)
    assert "test.typo" not in RULES


def test_every_rule_asks_for_known_signals_and_explains_what_is_missing() -> None:
    load_rules()
    for r in RULES.values():
        for name in (*r.needs, *r.needs_any):
            assert signals.known(name), (r.id, name)
            assert "(" in signals.where_from(name), name  # says where the signal would come from


def test_the_timeline_names_its_tables_from_the_vocabulary() -> None:
    tl = timeline_from_records(read_jsonl_gz(FIXTURES / "loader-refresh.jsonl.gz"))
    present = tl.signals()
    assert {"requests", "loader"} <= present
    assert all(name in signals.TABLES for name in present if ":" not in name)


def test_not_evaluated_says_where_the_signal_comes_from() -> None:
    records = [r for r in read_jsonl_gz(FIXTURES / "healthy.jsonl.gz") if r["kind"] != "request"]
    entry = next(e for e in analyze(timeline_from_records(records)).not_evaluated if e["rule"] == "requests.queue_backlog")
    assert entry["missing"] == ["requests"] and "per-request rows" in entry["why"][0]
