"""The diagnosis answers the alert that opened the incident: never ``healthy`` under a firing alert, and it says
what it could not see. Real flight recorders written from real scenario recordings, the real rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.triage.diagnosis import run_analysis
from tests.paths import REPO

SLO_QUEUE = {"alertname": "LLMDiagSLOBurn", "slo": "queue-wait", "job": "llm-backend", "model": "demo", "severity": "page"}
CAUSE_QUEUE = {"alertname": "LLMDiagQueueWaitDominates", "diag_class": "queue_backlog", "job": "llm-backend"}


def recorder(name: str, path: Path, *, drop: tuple[str, ...] = ()) -> tuple[float, float]:
    records = [r for r in read_jsonl_gz(REPO / "tests/fixtures/scenarios" / f"{name}.jsonl.gz") if r["kind"] not in drop]
    rec = FlightRecorder(path, retention_s=10**9)
    rec.write_rows([(r["ts"], r["kind"], int(r.get("schema", 1)), json.dumps(r)) for r in records])
    rec.close()
    ts = [r["ts"] for r in records]
    return min(ts), max(ts)


def analyse(path: Path, span: tuple[float, float], labels: dict[str, str] | None, *, firing: bool = True) -> dict:
    first, last = span
    return run_analysis("recorder", str(path), "", last - first + 5, last + 1, labels, firing)


@pytest.fixture(scope="module")
def recorders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agreement")
    return {
        "healthy": (folder / "healthy.db", recorder("healthy", folder / "healthy.db")),
        "healthy-untracked": (folder / "untracked.db", recorder("healthy", folder / "untracked.db", drop=("request",))),
        "queue": (folder / "queue.db", recorder("queue", folder / "queue.db")),
    }


def test_a_firing_slo_burn_over_a_recorder_without_requests_says_what_it_could_not_see(recorders):
    path, span = recorders["healthy-untracked"]
    plain = analyse(path, span, None)
    assert plain["verdict"]["primary"] == "healthy"  # what the rules alone say: memory and PSI are fine
    doc = analyse(path, span, SLO_QUEUE)
    check = doc["alert_check"]
    assert doc["verdict"]["primary"] == "inconclusive"
    assert check["status"] == "could_not_see" and "requests" in check["missing"]
    assert "could not see the queue-wait SLO's requests" in check["text"] and "--prometheus" in check["text"]
    assert doc["verdict"]["alert"] == check["text"]


def test_never_healthy_while_the_alert_fires_even_when_every_signal_is_there(recorders):
    path, span = recorders["healthy"]
    doc = analyse(path, span, SLO_QUEUE)
    assert doc["verdict"]["primary"] == "inconclusive"
    assert doc["alert_check"]["status"] == "unexplained"
    assert "fires, but no rule found a cause" in doc["verdict"]["alert"]


def test_a_resolved_alert_over_a_healthy_window_stays_healthy(recorders):
    path, span = recorders["healthy"]
    assert analyse(path, span, SLO_QUEUE, firing=False)["verdict"]["primary"] == "healthy"


def test_a_cause_alert_is_confirmed_or_contradicted_by_the_rules(recorders):
    path, span = recorders["queue"]
    confirmed = analyse(path, span, CAUSE_QUEUE)["alert_check"]
    assert (confirmed["status"], confirmed["stated_class"]) == ("confirms", "queue_backlog")
    differs = analyse(path, span, {**CAUSE_QUEUE, "diag_class": "memory_leak"})
    assert differs["alert_check"]["status"] == "differs" and differs["verdict"]["primary"] == "queue_backlog"


def test_a_confirmed_stated_class_is_the_incidents_class_even_under_an_earlier_problem():
    """An OOM kill minutes after a queue overload, both inside the lookback: the analysis ranks the backlog first;
    the OOM page's incident is still an OOM incident (the rules confirm it), and its check names the backlog too."""
    from diag.rules.engine import load_rules
    from diag.triage.agreement import check
    from diag.triage.diagnosis import verdict_class

    load_rules()
    doc = {
        "verdict": {"primary": "queue_backlog", "contributing": ["host_oom"], "suspects": []},
        "findings": [{"class": "queue_backlog", "confidence": 0.9}, {"class": "host_oom", "confidence": 0.85}],
        "evaluated": ["requests.queue_backlog", "oom.host"], "not_evaluated": [],
    }  # fmt: skip
    labels = {"alertname": "LLMDiagCgroupOOMKill", "diag_class": "host_oom", "job": "llm-diag-host", "severity": "page"}
    doc["alert_check"] = entry = check(doc, labels, firing=True)
    assert (entry["status"], entry["incident_class"], verdict_class(doc)) == ("confirms", "host_oom", "host_oom")
    assert "also shows queue_backlog at 0.90" in entry["text"]
    assert doc["verdict"]["primary"] == "queue_backlog"  # the analysis itself is left as it was
    suspect = {**doc, "findings": [{"class": "queue_backlog", "confidence": 0.9}, {"class": "host_oom", "confidence": 0.4}]}
    weak = check(suspect, labels, firing=True)
    assert (weak["status"], weak["incident_class"]) == ("suspect", "queue_backlog")  # not confirmed: the verdict stands
