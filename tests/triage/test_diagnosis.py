"""Diagnosis on every incident, asynchronously, from a real flight recorder: stored verdict, findings with evidence,
rules not evaluated; re-diagnosed on reopen; a note only when the class changes.

The recorder holds the records of a real ``diag demo --scenario leak`` run (the replay fixture), written into a
real FlightRecorder file; the alert's startsAt is set inside that run, so [startsAt - 30 min, now] covers it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from diag.triage.diagnosis import Source, promql_selector
from diag.triage.lifecycle import Policy
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.store import connect
from tests.procs import poll_until
from tests.triage.helpers import alert, body, recorder_from_fixture

LABELS = {"alertname": "ServiceMemoryHigh", "job": "llm", "instance": "127.0.0.1:8000"}


@pytest.fixture(scope="module")
def leak_receiver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diag")
    first, last = recorder_from_fixture("leak", folder / "recorder.db")
    config = ReceiverConfig(
        host="127.0.0.1", port=0, db=folder / "triage.db", policy=Policy(hold_down_s=0, sinks=("github",)),
        source=Source("recorder", str(folder / "recorder.db")),
    )  # fmt: skip
    rx = Receiver(config)
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    yield rx, first, last
    rx.close()


def wait_diagnosed(db_path: Path, incident_id: int, timeout_s: float = 120.0) -> dict:
    db = connect(db_path)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = dict(db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone())
            if row["diag_state"] in ("done", "failed"):
                return row
            time.sleep(0.2)
        raise AssertionError(f"incident {incident_id} not diagnosed within {timeout_s}s")
    finally:
        db.close()


def _column(db, name: str) -> object:
    return db.execute(f"SELECT {name} FROM incidents WHERE id = 1").fetchone()[0]


@pytest.mark.process
def test_incident_diagnosed_async_then_rediagnosed_on_reopen(leak_receiver):
    rx, _first, last = leak_receiver
    url = f"http://127.0.0.1:{rx.port}/webhook"
    starts = last - 5
    t0 = time.monotonic()
    r = httpx.post(url, json=body(alert(LABELS, starts=starts)), timeout=10)
    answered = time.monotonic() - t0
    assert r.status_code == 200 and answered < 1.0  # the webhook does not wait for the analysis
    row = wait_diagnosed(rx.config.db, 1)
    assert row["diag_state"] == "done", row["diag_error"]
    assert row["diag_class"] == "memory_leak"
    doc = json.loads(row["diag_doc"])
    leak = next(f for f in doc["findings"] if f["class"] == "memory_leak")
    assert leak["evidence"] and all("what" in e for e in leak["evidence"])
    assert all(entry["rule"] and entry["missing"] for entry in doc["not_evaluated"])  # each says what it lacked
    assert doc["triage"]["since_s"] >= 1800 and doc["triage"]["source"].startswith("recorder")

    db = connect(rx.config.db)
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE incident_id = 1 ORDER BY id")]
    assert kinds == ["opened", "diagnosis"]
    assert [a for (a,) in db.execute("SELECT action FROM outbox ORDER BY id")] == ["create", "diagnosis"]

    # resolve, then fire again: reopened and re-diagnosed; same class -> no note for the tickets
    httpx.post(url, json=body(alert(LABELS, "resolved", starts=starts)), timeout=10)
    assert poll_until(lambda: _column(db, "status") == "resolved", 10)
    httpx.post(url, json=body(alert(LABELS, starts=last - 1)), timeout=10)
    assert poll_until(lambda: _column(db, "reopen_count") == 1, 10)  # reopened: its diagnosis is pending again
    row = wait_diagnosed(rx.config.db, 1)
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE incident_id = 1 ORDER BY id")]
    assert kinds[-2:] == ["reopened", "rediagnosed"] and row["reopen_count"] == 1
    actions = [a for (a,) in db.execute("SELECT action FROM outbox ORDER BY id")]
    assert actions == ["create", "diagnosis", "close", "reopen"]

    # a previous diagnosis that said something else: the re-diagnosis notes the change
    db.execute("UPDATE incidents SET diag_class = 'thrashing' WHERE id = 1")
    httpx.post(url, json=body(alert(LABELS, "resolved", starts=last - 1)), timeout=10)
    assert poll_until(lambda: _column(db, "status") == "resolved", 10)
    httpx.post(url, json=body(alert(LABELS, starts=last)), timeout=10)
    assert poll_until(lambda: _column(db, "reopen_count") == 2, 10)
    row = wait_diagnosed(rx.config.db, 1)
    assert row["diag_class"] == "memory_leak" and row["reopen_count"] == 2
    text = db.execute("SELECT text FROM events WHERE kind = 'class_changed'").fetchone()[0]
    assert text == "re-diagnosed: thrashing -> memory_leak"
    assert (
        db.execute("SELECT text FROM outbox WHERE action = 'diagnosis' ORDER BY id DESC")
        .fetchone()[0]
        .startswith("Class changed: thrashing -> memory_leak")
    )
    page = httpx.get(f"http://127.0.0.1:{rx.port}/incidents/1", timeout=10).text
    assert "memory_leak" in page and "Timeline" in page
    db.close()


def test_promql_selector_from_alert_labels_is_escaped():
    labels = {"job": 'llm"api', "instance": "10.0.0.5:8000", "pod": "x"}
    assert promql_selector(labels, ("job", "instance")) == 'job="llm\\"api",instance="10.0.0.5:8000"'
    assert promql_selector({"job": "a\\b\nc"}, ("job", "instance")) == 'job="a\\\\b\\nc"'


@pytest.mark.process
def test_bundle_on_page_runs_diag_bundle_once_for_paging_incidents(tmp_path):
    _first, last = recorder_from_fixture("leak", tmp_path / "recorder.db")
    config = ReceiverConfig(
        host="127.0.0.1", port=0, db=tmp_path / "triage.db", policy=Policy(),
        source=Source("recorder", str(tmp_path / "recorder.db")), bundle_on="page", bundle_dir=tmp_path / "bundles",
    )  # fmt: skip
    rx = Receiver(config)
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{rx.port}/webhook"
        assert httpx.post(url, json=body(alert({**LABELS, "severity": "page"}, starts=last)), timeout=10).is_success
        assert httpx.post(
            url, json=body(alert({**LABELS, "alertname": "Minor", "severity": "ticket"}, starts=last)), timeout=10
        ).is_success
        paged, ticket = wait_diagnosed(rx.config.db, 1, 240), wait_diagnosed(rx.config.db, 2, 240)
        assert paged["bundle_path"] and (Path(paged["bundle_path"]) / "manifest.json").exists()
        assert Path(paged["bundle_path"]).parent == tmp_path / "bundles"
        assert ticket["bundle_path"] is None  # severity=ticket: no bundle
    finally:
        rx.close()


@pytest.mark.process
@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_the_diagnosis_worker_never_outlives_the_receiver(tmp_path, how):
    import psutil

    from tests.triage.helpers import ReceiverProcess

    recorder_from_fixture("leak", tmp_path / "recorder.db")
    rx = ReceiverProcess(tmp_path / "triage.db", "--recorder", str(tmp_path / "recorder.db")).start()
    try:
        children = psutil.Process(rx.proc.pid).children(recursive=True)
        assert children, "the receiver runs its diagnosis worker in a child process"
        if how == "kill9":
            rx.kill9()
        else:
            rx.stop()
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        rx.stop()
        for p in locals().get("children") or []:  # a failed run must not leave the workers it found behind
            with contextlib.suppress(psutil.Error):
                p.kill()
