"""Diagnosis from Prometheus (the fleet path): a real Prometheus 2.42 scraping a real ``diag collect`` agent; the
receiver builds the selector from the alert's job/instance labels and stores what the rules made of that window.
An alert for an instance Prometheus has never seen gets an analysis with nothing evaluated: the selector is used."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from diag.triage.diagnosis import Source
from diag.triage.lifecycle import Policy
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.store import connect
from tests.promserver import ScrapeJob, free_port, prometheus, require_prometheus
from tests.triage.helpers import REPO, alert, body

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_prometheus()
    folder = tmp_path_factory.mktemp("prom")
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "diag.cli", "collect", "--interval", "1s", "--listen", f"127.0.0.1:{port}", "--no-gpu",
         "--no-kmsg", "--recorder", str(folder / "agent.db")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        with prometheus([ScrapeJob("llm-host", [f"127.0.0.1:{port}"])]) as prom:
            assert prom.wait_for("count_over_time(up{job='llm-host'}[2m]) >= 12", bool, timeout_s=90), prom.log_tail()
            rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=folder / "t.db", policy=Policy(),
                                         source=Source("prometheus", prom.url)))  # fmt: skip
            threading.Thread(target=rx.serve_forever, daemon=True).start()
            yield rx, port
            rx.close()
    finally:
        os.kill(agent.pid, signal.SIGTERM)
        agent.wait(timeout=30)


def diagnosed(rx: Receiver, alertname: str, timeout_s: float = 180) -> dict:
    db = connect(rx.config.db)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = db.execute("SELECT * FROM incidents WHERE title LIKE ?", (f"%alertname={alertname} %",)).fetchone()
            if row is not None and row["diag_state"] in ("done", "failed"):
                return dict(row)
            time.sleep(0.3)
    finally:
        db.close()
    raise AssertionError(f"{alertname}: no diagnosis within {timeout_s}s")


@pytest.mark.slow
def test_selector_from_alert_labels_drives_the_prometheus_diagnosis(fleet):
    rx, port = fleet
    url = f"http://127.0.0.1:{rx.port}/webhook"
    instance = f"127.0.0.1:{port}"
    now = time.time()
    assert httpx.post(url, json=body(alert({"alertname": "HostSeen", "job": "llm-host", "instance": instance}, starts=now)),
                      timeout=10).is_success  # fmt: skip
    assert httpx.post(url, json=body(alert({"alertname": "HostUnseen", "job": "llm-host", "instance": "10.9.9.9:1"}, starts=now)),
                      timeout=10).is_success  # fmt: skip
    seen, unseen = diagnosed(rx, "HostSeen"), diagnosed(rx, "HostUnseen")
    assert seen["diag_state"] == "done", seen["diag_error"]
    doc = json.loads(seen["diag_doc"])
    assert doc["triage"]["selector"] == f'job="llm-host",instance="{instance}"'
    assert doc["triage"]["source"].startswith("prometheus http://127.0.0.1:")
    assert doc["verdict"]["primary"] == seen["diag_class"]
    assert doc["evaluated"], "host series were found, so host rules were evaluated"
    other = json.loads(unseen["diag_doc"])
    assert len(other["evaluated"]) < len(doc["evaluated"])  # nothing matches that selector
