"""Real runs of scenario parameter variants the rules once got wrong, replayed through the rules.

The ``host-oom`` variant with a 24 MiB margin: memory pressure reached 0.9 and outranked the OOM kill in the
service's own group (0.85); the kill is what the person on call must act on.

The two ``thrash`` variants thrash on refaults of evicted page cache more than on major faults, and
finish too few requests (20-23) for the per-request thrashing test. The stall-only rule finds the
thrashing (0.8); memory pressure, the broader class, saw the same stalls and used to win at 0.9.
See ``tests/fixtures/scenarios/README.md`` for how they were recorded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records

VARIANTS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios" / "variants"


@pytest.mark.parametrize("name", ["thrash-headroom-0.3", "thrash-160mb-steps-2-4-8"])
def test_refault_thrashing_with_few_requests_is_thrashing_not_pressure(name: str) -> None:
    records = read_jsonl_gz(VARIANTS / f"{name}.jsonl.gz")
    started = sum(1 for r in records if r["kind"] == "request" and r.get("start") is not None)
    assert started < 30  # the case: too few rows for the per-request test
    analysis = analyze(timeline_from_records(records, source=name))
    by_rule = {f.rule: f for f in analysis.findings}
    assert analysis.primary == "thrashing", [(f.rule, f.confidence) for f in analysis.findings]
    assert by_rule["stalls.thrashing"].confidence >= 0.6
    pressure = by_rule["memory.pressure"]
    assert pressure.confidence <= 0.45 and "see the thrashing finding" in pressure.summary


@pytest.mark.parametrize("name", ["thrash-headroom-0.3", "thrash-160mb-steps-2-4-8"])
def test_without_the_tracker_the_same_run_is_thrashing(name: str) -> None:
    records = [r for r in read_jsonl_gz(VARIANTS / f"{name}.jsonl.gz") if r["kind"] in ("host", "cgroup", "process", "oom")]
    analysis = analyze(timeline_from_records(records, source=name))
    assert analysis.primary == "thrashing", [(f.rule, f.confidence) for f in analysis.findings]


def test_an_oom_kill_after_strong_pressure_is_the_oom_incident() -> None:
    records = read_jsonl_gz(VARIANTS / "host-oom-margin-24.jsonl.gz")
    analysis = analyze(timeline_from_records(records, source="host-oom-margin-24"))
    by_rule = {f.rule: f for f in analysis.findings}
    assert analysis.primary == "host_oom", [(f.rule, f.confidence) for f in analysis.findings]
    pressure, kill = by_rule["memory.pressure"], by_rule["oom.host"]
    assert 0.5 <= pressure.confidence < kill.confidence  # still named, as contributing
    assert "memory_pressure" in analysis.contributing and "see the OOM finding" in pressure.summary
