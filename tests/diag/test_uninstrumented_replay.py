"""Replay the records of the live uninstrumented runs (``test_live_uninstrumented.py``) through the rules.

Each ``tests/fixtures/uninstrumented/<case>.jsonl.gz`` holds what the agent recorded in one real run (plain
processes in limited memory cgroups, no request tracker) plus the ``watch_scope`` record naming what the
operator watched; re-record with ``LLMDIAG_RECORD_FIXTURES=tests/fixtures/uninstrumented pytest -m live
tests/diag/test_live_uninstrumented.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "uninstrumented"
CASES = {
    "thrash-no-rows": ("thrashing", "stalls.thrashing"),
    "neighbour-holds-bin": ("noisy_neighbour", "placement.noisy_neighbour"),
    "duplicates-no-files": ("duplicate_model_processes", "private_copies.duplicate_models"),
    "short-overload": ("queue_backlog", "requests.queue_backlog"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_recorded_uninstrumented_run_keeps_its_verdict(name: str) -> None:
    records = read_jsonl_gz(FIXTURES / f"{name}.jsonl.gz")
    kinds = {r["kind"] for r in records}
    assert "watch_scope" in kinds and not kinds & {"batch", "loader", "config", "routing"}  # nothing from a tracker
    analysis = analyze(timeline_from_records(records, source=name))
    expected, by_rule = CASES[name]
    assert analysis.primary == expected, [(f.rule, f.confidence, f.summary) for f in analysis.findings]
    assert any(f.rule == by_rule and f.confidence >= 0.5 for f in analysis.findings)


def test_the_neighbour_holding_a_bin_file_is_not_the_service() -> None:
    records = read_jsonl_gz(FIXTURES / "neighbour-holds-bin.jsonl.gz")
    tl = timeline_from_records(records)
    from diag.rules.stats import service_scope

    scope = service_scope(tl)
    holders = {t.pid for t in tl.processes.values() if t.model_files}
    assert holders and not holders & scope.pids  # the .bin holder is a neighbour
    assert scope.identified_by.startswith("watch scope") and len(scope.cgroups) == 1
    # Without the watch scope, the watched groups still keep the holder out unless it is inside them -- here it is
    # (both groups were watched), which is exactly why the operator's own scope has to come first.
    without = timeline_from_records([r for r in records if r["kind"] != "watch_scope"])
    assert service_scope(without).identified_by == "model holders"
