"""Thrashing from stall signals alone (no request rows), on synthetic records and on recorded fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import Finding, TooLittleData
from diag.rules.engine import analyze
from diag.rules.stalls import thrashing_from_stalls
from diag.timeline import timeline_from_records

T0 = 1_700_000_000.0
GROUP = "/svc"
SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
TRACKER_KINDS = {"request", "batch", "routing", "loader", "config", "torch_memory", "cuda_oom"}


def _records(seconds: int, full_pct: float, faults_per_s: float, *, stall_from: int = 10) -> list[dict[str, Any]]:
    """A watched 150 MiB group sampled at 1 Hz: calm, then stalled (PSI full) from ``stall_from`` s on."""
    out: list[dict[str, Any]] = [
        {"kind": "watch_scope", "ts": T0, "cgroups": [GROUP], "resolved_cgroups": [GROUP]},
    ]
    full_us = some_us = 0.0
    faults = 0.0
    for i in range(seconds):
        hot = i >= stall_from
        full_us += (full_pct if hot else 0.0) / 100 * 1e6
        some_us += (min(100.0, 2 * full_pct) if hot else 0.0) / 100 * 1e6
        faults += faults_per_s if hot else 0.0
        out.append({
            "kind": "cgroup", "ts": T0 + i, "path": GROUP, "usage_bytes": 150 << 20, "limit_bytes": 150 << 20,
            "stat": {"pgmajfault": faults, "anon": 100 << 20},
            "pressure": {"some": {"avg10": 0.0, "total_us": some_us}, "full": {"avg10": 0.0, "total_us": full_us}},
        })  # fmt: skip
        out.append({"kind": "host", "ts": T0 + i, "memory": {"total": 8 << 30, "available": 6 << 30}})
    return out


def test_sustained_full_stall_with_major_faults_is_thrashing_with_time_ranges() -> None:
    tl = timeline_from_records(_records(40, full_pct=12.0, faults_per_s=400.0))
    f = thrashing_from_stalls(tl)
    assert isinstance(f, Finding) and f.cls == "thrashing" and f.confidence >= 0.7
    assert f.start is not None and f.end is not None and T0 + 9 <= f.start < f.end <= T0 + 40
    whats = " ".join(e.what for e in f.evidence)
    assert "psi.memory.full" in whats and "pgmajfault" in whats
    a = analyze(tl)
    assert a.primary == "thrashing"


def test_full_stall_without_page_ins_is_only_a_suspect() -> None:
    tl = timeline_from_records(_records(40, full_pct=8.0, faults_per_s=0.0))
    f = thrashing_from_stalls(tl)
    assert isinstance(f, Finding) and 0.3 <= f.confidence < 0.5
    a = analyze(tl)  # the group sits at its limit with PSI some 16 %: pressure may be named, never thrashing
    assert a.primary not in ("thrashing", "healthy")
    assert "thrashing" in [s["class"] for s in a.suspects]


def test_calm_group_finds_nothing() -> None:
    tl = timeline_from_records(_records(40, full_pct=0.5, faults_per_s=5.0))
    assert thrashing_from_stalls(tl) is None


def test_a_few_seconds_are_too_little_data() -> None:
    tl = timeline_from_records(_records(4, full_pct=30.0, faults_per_s=900.0, stall_from=0))
    result = thrashing_from_stalls(tl)
    assert isinstance(result, TooLittleData) and "5 samples" in result.needed


def test_neighbour_group_stalls_are_not_the_service_thrashing() -> None:
    """Stalls in a watched group that is not the service (the operator named another) are not its thrashing."""
    recs = _records(40, full_pct=12.0, faults_per_s=400.0)
    recs[0] = {"kind": "watch_scope", "ts": T0, "cgroups": ["/svc-other"], "resolved_cgroups": ["/svc-other"]}
    recs += [{"kind": "cgroup", "ts": T0 + i, "path": "/svc-other", "usage_bytes": 10 << 20} for i in range(40)]
    assert thrashing_from_stalls(timeline_from_records(recs)) is None


@pytest.mark.parametrize(("name", "expected"), [("thrash", "thrashing"), ("healthy", "healthy"), ("pressure", "memory_pressure")])
def test_recorded_scenarios_without_the_tracker(name: str, expected: str) -> None:
    """The recorded runs with every tracker record removed: what an uninstrumented service leaves."""
    recs = [r for r in read_jsonl_gz(SCENARIOS / f"{name}.jsonl.gz") if r["kind"] not in TRACKER_KINDS]
    a = analyze(timeline_from_records(recs, source=name))
    assert a.primary == expected, [(f.cls, f.rule, f.confidence) for f in a.findings]
    if expected == "thrashing":
        assert any(f.rule == "stalls.thrashing" and f.confidence >= 0.5 for f in a.findings)


def test_prometheus_shaped_series_judge_the_same() -> None:
    """The fleet path has no cumulative PSI per sample from the agent's record, only series built from the exporter's
    totals; the rule reads the same Timeline names either way (here: a Timeline with derived avg10 and counters)."""
    from diag.timeline import Series, Timeline

    tl = timeline_from_records(_records(40, full_pct=12.0, faults_per_s=400.0))
    group = tl.cgroups[GROUP]
    fleet = Timeline(start=tl.start, end=tl.end, source="prometheus:test", host=tl.host)
    full = group["psi.memory.full.total_s"].rate()
    fleet.cgroups[GROUP] = {
        "psi.memory.full.avg10": Series(full.ts, full.values * 100.0),
        "stat.pgmajfault": group["stat.pgmajfault"],
        "limit": group["limit"],
        "usage": group["usage"],
    }
    f = thrashing_from_stalls(fleet)
    assert isinstance(f, Finding) and f.confidence >= 0.7
