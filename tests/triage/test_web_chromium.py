"""The receiver's page in a real headless Chromium: incidents listed, evidence charts drawn, no console messages
(errors, CSP violations), and label values carrying HTML/script arrive as text, never as elements.

Chromium prints console messages to stderr with ``--enable-logging=stderr``; a probe page with a deliberate
``console.error`` and a CSP violation proves the detector sees them, so a clean page is a real pass.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from diag.triage.diagnosis import Source
from diag.triage.lifecycle import Policy
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.store import connect
from tests.triage.helpers import alert, body, recorder_from_fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (apt-get install chromium)")
CONSOLE_RE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(?P<message>.*)")
EVIL = "<script>console.error('xss')</script><img src=x onerror=\"console.error('xss2')\">"


def chromium(url: str, profile: Path) -> tuple[str, list[str]]:
    argv = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", "--dump-dom", url,
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [m.group("message") for line in proc.stderr.splitlines() if (m := CONSOLE_RE.search(line))]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("web")
    _first, last = recorder_from_fixture("leak", folder / "recorder.db")
    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=folder / "t.db", policy=Policy(hold_down_s=0),
                                 source=Source("recorder", str(folder / "recorder.db"))))  # fmt: skip
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{rx.port}"
    labels = {"alertname": "ServiceMemoryHigh", "job": "llm", "instance": EVIL}
    assert httpx.post(f"{url}/webhook", json=body(alert(labels, starts=last - 5, summary=f"leak {EVIL}")), timeout=10).is_success
    other = {"alertname": "QueueBacklog", "job": "llm", "instance": "b"}
    assert httpx.post(f"{url}/webhook", json=body(alert(other, starts=last - 5)), timeout=10).is_success
    db = connect(rx.config.db)
    deadline = time.monotonic() + 120
    while (
        time.monotonic() < deadline and db.execute("SELECT COUNT(*) FROM incidents WHERE diag_state = 'done'").fetchone()[0] < 2
    ):
        time.sleep(0.2)
    db.close()
    yield url, folder
    rx.close()


@pytest.mark.process
def test_console_detector_sees_errors(tmp_path):
    probe = tmp_path / "probe.html"
    probe.write_text(
        '<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline'\"></head><body><script>console.error('llmdiag-probe')</script>"
        '<img src="http://127.0.0.1:9/blocked.png"></body></html>'
    )
    _, console = chromium(probe.as_uri(), tmp_path / "profile")
    assert any("llmdiag-probe" in m for m in console)


@pytest.mark.process
def test_incident_list_and_detail_render_cleanly_in_chromium(page, tmp_path):
    url, _ = page
    dom, console = chromium(f"{url}/", tmp_path / "p1")
    assert console == [], console
    rows = re.findall(r'<tr class="incident">', dom)
    assert len(rows) == 2
    assert "memory_leak" in dom and "QueueBacklog" in dom
    assert "<script>" not in dom and "<img" not in dom  # the label value is text, not elements

    dom, console = chromium(f"{url}/incidents/1", tmp_path / "p2")
    assert console == [], console
    assert 'id="verdict"' in dom and "memory_leak" in dom
    assert "<polyline" in dom  # an evidence chart drawn
    assert "<script>" not in dom and "&lt;script&gt;console.error" in dom
    assert 'id="timeline"' in dom and "opened" in dom and "diagnosis" in dom
