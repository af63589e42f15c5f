"""report.html in a real headless Chromium: no console messages (errors, CSP violations), charts drawn.

The page is self-contained by design (inline CSS and SVG, no script, a ``default-src 'none'`` CSP),
so *any* console message means something is wrong: a blocked fetch, a parse error. Chromium prints
console messages to stderr with ``--enable-logging=stderr``; a probe page with a deliberate
``console.error`` and a blocked fetch proves the detector sees them, so a clean report is a real pass.
The DOM is read back from the browser (``--dump-dom``), after parsing, not from our own file.
"""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import pytest

from tests.bundle.chromium import CHROMIUM, chromium
from tests.bundle.helpers import run_bundle, write_history

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian chromium (apt-get install -y --no-install-recommends chromium)"
)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.process
def test_the_console_detector_sees_errors_and_blocked_fetches(tmp_path: Path) -> None:
    probe = tmp_path / "probe.html"
    probe.write_text(
        '<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline'\"></head><body><script>console.error('llmdiag-probe')</script>"
        '<img src="http://127.0.0.1:9/blocked.png"></body></html>'
    )
    _, console = chromium(probe, "--dump-dom", profile=tmp_path / "profile")
    assert any("llmdiag-probe" in m for m in console)
    assert any("Content Security Policy" in m for m in console)


@pytest.mark.process
def test_report_html_renders_its_charts_without_console_messages(tmp_path: Path) -> None:
    rec = tmp_path / "recorder.db"
    write_history(rec, end=time.time(), seconds=300)
    run = run_bundle("--recorder", str(rec), "--since", "10m", "--cgroup", "/system.slice/llm.service", "--no-gpu",
                     "--deadline", "60s", out=tmp_path)  # fmt: skip
    report = run.root / "report.html"
    html = report.read_text()
    assert "http://" not in html.replace("http://www.w3.org/", "") and "https://" not in html  # nothing to fetch
    assert "<script" not in html

    dom, console = chromium(report, "--dump-dom", profile=tmp_path / "profile")
    assert console == [], console
    verdict = run.findings()["verdict"]["primary"]
    assert f"Verdict: {verdict}" in dom
    for key in ("memory", "psi", "queue", "throughput"):
        figure = re.search(rf'<figure id="chart-{key}".*?</figure>', dom, re.DOTALL)
        assert figure, f"chart {key} missing"
        svg = figure.group(0)
        assert "<svg" in svg and svg.count("<path") >= 3, f"chart {key} has nothing drawn"
    assert dom.count("<svg") >= 4
    assert re.search(r'<h2 id="not-evaluated">', dom) and re.search(r'<h2 id="collectors">', dom)

    shot = tmp_path / "report.png"
    chromium(report, f"--screenshot={shot}", "--window-size=1280,2000", "--hide-scrollbars", profile=tmp_path / "profile2")
    assert png_size(shot) == (1280, 2000)
    assert shot.stat().st_size > 50_000  # a page of text and charts, not a blank canvas (kept in tmp_path to look at)
