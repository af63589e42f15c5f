"""A live incident end to end: a real fault on the reference backend, the alert delivered by a real Alertmanager
pair, and the stored diagnosis naming the scenario's class.

The fault: the ``leak`` scenario (what ``diag demo --scenario leak`` runs) runs ``diag demo serve`` with a
deliberate per-request leak inside a real memory cgroup with a limit (the product's own ScenarioCgroups: created,
filled, killed by PID, removed), recorded by the real host agent into a flight recorder kept as
``--keep-recorder`` keeps it. The run is the session's (``leak_scenario`` in tests/conftest.py): tests/scenarios
asserts its cleanup and verdict, this module its triage. The alert is then
injected with ``amtool alert add`` into both Alertmanager peers (the Prometheus rules that would fire it are
built elsewhere); the receiver diagnoses from that recorder over [startsAt - 30 min, now].
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from diag.demo.scenarios.library import SCENARIOS
from tests.livecg import skip_reason
from tests.triage.amcluster import AlertmanagerPair, binaries
from tests.triage.helpers import ReceiverProcess

pytestmark = pytest.mark.live
SCENARIO = "leak"


@pytest.fixture(scope="module")
def fault(tmp_path_factory, leak_scenario):
    """The session's real ``leak`` run (tests/conftest.py): the first that reproduced the leak, as tests/scenarios
    judged it (a run that a busy host kept from leaving its signature would test the scenario, not triage)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    binaries()
    run = leak_scenario.reproduced()
    assert run.name == SCENARIO
    assert run.recorder.exists()
    return tmp_path_factory.mktemp("live"), run.recorder, run.started, run.finished


@pytest.mark.slow
def test_live_fault_alert_delivered_and_diagnosed_as_the_scenario_class(fault):
    folder, recorder, started, finished = fault
    rx = ReceiverProcess(folder / "triage.db", "--recorder", str(recorder)).start()
    pair = None
    try:
        pair = AlertmanagerPair(folder, f"{rx.url}/webhook")
        labels = {"alertname": "ServiceMemoryGrowing", "job": "llm-demo", "instance": "127.0.0.1:8000", "severity": "page"}
        # the alert fired while the leak ran (the run may have been made minutes before this test)
        pair.add(labels, start=finished, summary="llm-demo memory keeps growing")
        deadline = time.monotonic() + 300
        incident = None
        while time.monotonic() < deadline:
            rows = httpx.get(f"{rx.url}/api/incidents", timeout=10).json()
            if rows and rows[0]["diag_state"] in ("done", "failed"):
                incident = rows[0]
                break
            time.sleep(0.5)
        assert incident is not None, "no diagnosis stored"
        assert len(rows) == 1  # both peers delivered, one incident
        detail = httpx.get(f"{rx.url}/api/incidents/{incident['id']}", timeout=10).json()
        diagnosis = detail["incident"]["diagnosis"]
        assert detail["incident"]["diag_state"] == "done", detail["incident"]["diag_error"]
        expected = SCENARIOS[SCENARIO].expected
        assert detail["incident"]["diag_class"] == expected, json.dumps(diagnosis["findings"], indent=1)[:3000]
        finding = next(f for f in diagnosis["findings"] if f["class"] == expected)
        assert finding["evidence"]
        window = diagnosis["triage"]
        assert window["until"] - window["since_s"] <= started  # the window reaches back over the whole fault
    finally:
        if pair is not None:
            pair.stop()
        rx.stop()
