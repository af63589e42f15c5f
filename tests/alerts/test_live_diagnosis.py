"""The live diagnosis: the engine's verdict on a recorder becomes llmdiag_incident* series, bounded and stable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collectors import catalog as cat
from collectors.recorder import FlightRecorder
from collectors.records import record_from_dict
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.live.diagnosis import LiveDiagnosis
from diag.rules.classes import INCIDENT_CLASSES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
EVERYTHING = 1e10  # the fixtures were recorded in the past: analyse all of it


def _recorder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.db"
    rec = FlightRecorder(path, retention_s=1e12)
    try:
        rec.write(record_from_dict(r) for r in read_jsonl_gz(FIXTURES / f"{name}.jsonl.gz"))
    finally:
        rec.close()
    return path


def _scrape(live: LiveDiagnosis) -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(live)
    text = generate_latest(registry).decode()
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def test_nothing_exported_before_the_first_run(tmp_path: Path) -> None:
    live = LiveDiagnosis(_recorder(tmp_path, "healthy"), 15, window_s=EVERYTHING)
    assert _scrape(live) == {}


def test_host_oom_recording_is_concluded_and_explained(tmp_path: Path) -> None:
    live = LiveDiagnosis(_recorder(tmp_path, "host-oom"), 15, window_s=EVERYTHING)
    analysis = live.run_once()
    assert analysis.primary == "host_oom"
    got = _scrape(live)
    incident = {s.labels["class"]: s.value for s in got[cat.INCIDENT.name]}
    assert set(incident) == set(INCIDENT_CLASSES)  # every class, bounded, from the first run
    assert incident["host_oom"] == 1.0
    assert sum(incident.values()) == 1 + len(analysis.contributing)
    confidence = {s.labels["class"]: s.value for s in got[cat.INCIDENT_CONFIDENCE.name]}
    assert confidence["host_oom"] >= 0.5
    info = got[cat.INCIDENT_INFO.name]
    oom = [s for s in info if s.labels["class"] == "host_oom"]
    assert len(oom) == 1 and oom[0].value == 1.0
    finding = next(f for f in analysis.findings if f.cls == "host_oom")
    assert oom[0].labels["rule"] == finding.rule
    assert oom[0].labels["summary"] == " ".join(finding.summary.split())[: cat.INCIDENT_TEXT_MAX]
    assert oom[0].labels["evidence"].startswith(finding.evidence[0].what)
    assert all(len(s.labels["summary"]) <= cat.INCIDENT_TEXT_MAX for s in info)
    # the text is frozen while the class stays concluded: a second run keeps the same series
    live.run_once()
    assert _scrape(live)[cat.INCIDENT_INFO.name] == info


def test_healthy_recording_concludes_nothing(tmp_path: Path) -> None:
    live = LiveDiagnosis(_recorder(tmp_path, "healthy"), 15, window_s=EVERYTHING)
    assert live.run_once().primary == "healthy"
    got = _scrape(live)
    assert all(s.value == 0 for s in got[cat.INCIDENT.name])
    assert cat.INCIDENT_INFO.name not in got


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--diagnose-every", "2s"], "at least 5s"),
        (["--diagnose-every", "soon"], "--diagnose-every"),
        (["--diagnose-every", "15s", "--once"], "--diagnose-every cannot be used with --once"),
        (["--once", "--diagnose-every", "15s"], "--diagnose-every cannot be used with --once"),
    ],
)
def test_bad_diagnose_every_is_refused_before_work(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "diag.cli", "collect", "--recorder", str(tmp_path / "r.db"), *args],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "r.db").exists()
