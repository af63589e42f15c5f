"""Replay the recorded scenario fixtures through the rules: how rule changes are checked without re-running faults.

Each ``tests/fixtures/scenarios/<name>.jsonl.gz`` holds the records of one real run of
``diag demo --scenario <name>`` (host, cgroup, process, GPU, OOM samples from the agent; request,
batch, routing, loader and config records from the demo's tracker), scoped to the scenario's own
groups and processes (see ``diag.demo.scenarios.recording``). Replaying one is
``timeline_from_records`` + ``analyze``: the same path ``diag analyze`` takes, in well under a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios import SCENARIO_NAMES
from diag.demo.scenarios.library import SCENARIOS
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.demo.scenarios.signals import check_signals
from diag.rules.engine import MIN_CONFIDENCE, analyze
from diag.timeline import timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
MAX_FIXTURE_BYTES = 300 * 1024


def _load(name: str) -> list[dict]:
    path = FIXTURES / f"{name}.jsonl.gz"
    assert path.exists(), f"missing fixture {path}: record it with `diag demo --scenario {name} --export {path}`"
    return read_jsonl_gz(path)


def test_every_scenario_has_a_small_fixture() -> None:
    for name in SCENARIO_NAMES:
        path = FIXTURES / f"{name}.jsonl.gz"
        assert path.exists(), name
        assert path.stat().st_size < MAX_FIXTURE_BYTES, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_replayed_fixture_keeps_its_signature_and_verdict(name: str) -> None:
    records = _load(name)
    kinds = {r["kind"] for r in records}
    if SCENARIOS[name].defaults.get("dialect", "llmdiag") == "llmdiag":
        assert {"host", "cgroup", "process", "request", "config"} <= kinds  # agent and tracker both recorded
    else:  # an uninstrumented engine: the agent's samples and its scrapes of the engine's /metrics, no tracker
        assert {"host", "cgroup", "process", "backend"} <= kinds and not kinds & {"request", "config"}
    timeline = timeline_from_records(records, source=f"fixture:{name}")
    problems, summary = check_signals(name, timeline)  # weights size and workers from the config records
    assert problems == [], summary  # the recorded fault is what the scenario promises

    analysis = analyze(timeline)
    verdict = [f"{f.cls} {f.confidence:.2f} [{f.rule}] {f.summary}" for f in analysis.findings]
    if name == "healthy":
        assert [v for v, f in zip(verdict, analysis.findings, strict=True) if f.confidence >= MIN_CONFIDENCE] == []
    assert analysis.primary == SCENARIOS[name].expected, "\n".join(verdict)
