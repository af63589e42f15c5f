"""``diag gate --html``'s page and the series it draws, in-process: a gate result built from real step loads
(requests with known times, judged by the real criteria) and a Timeline of the run's host samples.

What must hold: the steps x criteria table says PASS/FAIL with each measured value and limit, a step that did
not run says so; each step's diagnosis is its primary class and the leading finding's evidence; the four
charts are drawn with every step's start and end marked; the target's credentials and a note's markup never
reach the page as such; and the series are the requests bucketed by their scheduled time.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from diag.cli.gate_html import BOUNDARY, render_html
from diag.gate.criteria import HostFacts, judge, quantile
from diag.gate.load import Result, StepLoad
from diag.gate.on_fail import BundleOutcome
from diag.gate.runner import GateReport, StepReport
from diag.gate.spec import parse_spec
from diag.gate.timeseries import run_series
from diag.rules.base import Evidence, Finding
from diag.rules.engine import Analysis
from diag.timeline import Series, Timeline
from diag.timeline.model import ProcessTrack

T0 = 1_800_000_000.0  # wall clock of the run's start
PID = 4242
SPEC = {
    "steps": [
        {"name": "normal", "rate": 4, "duration": "4s", "prompt_tokens": 8, "output_tokens": 8,
         "criteria": {"e2e_p99_s": 1, "error_ratio": 0.01}},
        {"name": "peak", "rate": 10, "duration": "4s", "prompt_tokens": 8, "output_tokens": 8,
         "criteria": {"e2e_p99_s": 1, "psi_memory_some_avg10": 10}},
        {"name": "recovery", "rate": 2, "duration": "4s", "prompt_tokens": 8, "output_tokens": 8},
    ]
}  # fmt: skip
PEAK_LATENCIES = [0.3 + 0.25 * i for i in range(40)]  # a queue: each request waits longer than the one before


def _load(spec_step, wall0: float, latencies: list[float], rate: float) -> StepLoad:  # type: ignore[no-untyped-def]
    """A step's load on a loop clock starting at 100.0: one request every 1/rate s, each taking its latency."""
    t0 = 100.0
    results = [Result(scheduled=t0 + i / rate, sent=t0 + i / rate, done=t0 + i / rate + lat, status=200, output_tokens=8)
               for i, lat in enumerate(latencies)]  # fmt: skip
    load_end = t0 + spec_step.duration_s
    return StepLoad(spec_step, t0, wall0, results, load_end=load_end, end=max(load_end, max(r.done for r in results)))


def _analysis(primary: str, finding: Finding | None) -> Analysis:
    return Analysis(primary, [], [finding] if finding else [], [], (T0, T0 + 10))


def _report(target: str = "http://127.0.0.1:8000") -> GateReport:
    spec = parse_spec(SPEC, source="gate.yaml")
    normal, peak, _ = spec.steps
    report = GateReport(spec, target)
    quiet = HostFacts(2.0, "host", 0)
    load = _load(normal, T0, [0.2] * 16, 4)
    report.steps.append(StepReport(normal, load, judge(load, normal.criteria, quiet), quiet, _analysis("healthy", None)))
    backlog = Finding("queue_backlog", "requests.queue_backlog", 0.9, "requests waited for the one slot, 3.1 s at p95",
                      evidence=[Evidence("queue wait p95", 3.1, "s")])  # fmt: skip
    pressed = HostFacts(23.5, "host", 0)
    load = _load(peak, T0 + 5, PEAK_LATENCIES, 10)
    report.steps.append(StepReport(peak, load, judge(load, peak.criteria, pressed), pressed, _analysis("queue_backlog", backlog)))
    report.notes.append("peak: <b>not bold</b> a note with markup")
    report.bundle = BundleOutcome("/var/tmp/llm-diag-bundle-x", "/var/tmp/llm-diag-bundle-x.tar.gz", 4.0)
    return report


def _timeline() -> Timeline:
    ts = np.arange(T0 - 2, T0 + 20, 1.0)
    psi = np.where((ts >= T0 + 5) & (ts < T0 + 16), 23.5, 2.0)
    rss = 512 * 2**20 + (ts - T0) * 2**20
    track = ProcessTrack(PID, 1.0, comm="server", series={"rss": Series(ts, rss)})
    return Timeline(T0 - 2, T0 + 20, host={"psi.memory.some.avg10": Series(ts, psi)}, processes={track.key: track})


def test_the_series_bucket_the_requests_by_their_scheduled_time() -> None:
    run = run_series(_report(), _timeline(), pids=(PID,))
    assert [s.name for s in run.steps] == ["normal", "peak"] and [s.state for s in run.steps] == ["PASS", "FAIL"]
    assert run.bucket_s == 1.0
    i_normal, i_peak = 1, 6  # buckets [T0+1, T0+2) and [T0+6, T0+7)
    assert run.sent_rps[i_normal] == 4 and run.asked_rps[i_normal] == 4
    assert run.sent_rps[i_peak] == 10 and run.asked_rps[i_peak] == 10
    assert np.isnan(run.asked_rps[4]) or run.asked_rps[4] == 4  # between the steps: no rate asked beyond normal's end
    assert run.e2e_p50_s[i_normal] == pytest.approx(0.2)
    assert run.e2e_p99_s[i_peak + 1] > run.e2e_p99_s[i_peak] > 1.0  # the queue grows through the peak
    assert np.isnan(run.e2e_p99_s[4])  # no request was scheduled in the pause between the steps
    assert list(run.memory) == [f"pid {PID} (server) RSS"] and run.memory_scope == "the watched processes"
    assert list(run.psi) == ["host memory some"]


def _boundary_moves(svg: str) -> int:
    path = re.search(rf'<path d="([^"]*)" fill="none" stroke="{BOUNDARY}"', svg)
    assert path, "no step boundaries drawn"
    return path.group(1).count("M")


def test_the_page_has_the_table_the_diagnoses_and_charts_with_the_step_boundaries(tmp_path: Path) -> None:
    html = render_html(_report("http://user:s3cret@127.0.0.1:8000"), _timeline(), pids=(PID,), argv=["diag", "gate"])
    (tmp_path / "gate.html").write_text(html)  # to look at
    assert "GATE NOT PASSED: interrupted after 2 of 3 steps" not in html and "GATE FAILED: peak" in html
    normal = re.search(r'<tr id="step-normal">.*?</tr>', html, re.S).group(0)  # type: ignore[union-attr]
    peak = re.search(r'<tr id="step-peak">.*?</tr>', html, re.S).group(0)  # type: ignore[union-attr]
    assert re.search(r'class="ok"[^>]*>PASS 200 ms<span class="limit">limit &lt;= 1.00 s', normal)
    p99 = quantile(PEAK_LATENCIES, 0.99)  # 9.95 s
    assert re.search(rf'class="bad"[^>]*>FAIL {p99:.2f} s<span class="limit">limit &lt;= 1.00 s', peak)
    assert re.search(r'class="bad"[^>]*>FAIL 23.5 %', peak)
    assert re.search(r'<tr id="step-recovery"><td>recovery</td><td></td><td class="dim">NOT RUN', html)
    diagnosis = re.search(r'<table class="diagnosis">.*?</table>', html, re.S).group(0)  # type: ignore[union-attr]
    assert "<strong>queue_backlog</strong>" in diagnosis and "queue wait p95: 3.1 s" in diagnosis
    assert "queue_backlog: requests waited for the one slot, 3.1 s at p95" in diagnosis
    assert "<strong>healthy</strong>" in diagnosis
    for key in ("load", "latency", "psi", "memory"):
        figure = re.search(rf'<figure id="chart-{key}".*?</figure>', html, re.S)
        assert figure, f"chart {key} missing"
        assert _boundary_moves(figure.group(0)) == 4  # two steps, a pause between them: four edges
    assert "/var/tmp/llm-diag-bundle-x.tar.gz" in html
    assert "s3cret" not in html and "127.0.0.1:8000/v1/completions" in html
    assert "<b>not bold</b>" not in html and "&lt;b&gt;not bold&lt;/b&gt;" in html
    assert "<script" not in html and not re.search(r"""(src|href)=["']?https?:""", html)  # nothing to fetch


def test_a_run_that_sent_nothing_still_renders(tmp_path: Path) -> None:
    report = GateReport(parse_spec(SPEC, source="gate.yaml"), "http://127.0.0.1:8000", interrupted=True)
    html = render_html(report, None, argv=["diag"])
    assert "GATE NOT PASSED: interrupted after 0 of 3 steps" in html and "Nothing to draw" in html
    assert html.count("NOT RUN") == 3
