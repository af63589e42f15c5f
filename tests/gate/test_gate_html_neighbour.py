"""The neighbour's section of ``diag gate --html``: the negative check's verdict, each criterion, the protection the
service had, its resident and file-backed memory before the neighbour and while it held, its major faults and
memory stall, the OOM kills and the diagnosis -- rendered by headless Chromium (a real browser's DOM, no console
message), and a check that could not run says why.

The outcome is judged by the real ``judge_neighbour`` from samples with known figures (a service that lost 40 % of
its resident memory, three quarters of its mapped weights, and stalled while a neighbour held 96 MiB), so every
figure on the page can be checked against what was put in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diag.cli.gate_html import render_html
from diag.gate.criteria import HostFacts, judge
from diag.gate.load import Result, StepLoad
from diag.gate.neighbour import NeighbourRun, TargetSample, judge_neighbour, not_run
from diag.gate.neighbour_group import TargetGroup
from diag.gate.runner import GateReport, StepReport
from diag.gate.spec import parse_spec
from diag.rules.engine import Analysis
from tests.bundle.chromium import CHROMIUM, chromium

MiB = 1 << 20
T0 = 1_800_000_000.0
CRITERIA = {"max_target_reclaimed_ratio": 0.1, "e2e_p99_s": 1, "max_latency_ratio": 2, "oom_kills": 0}
DOC = {
    "defaults": {"prompt_tokens": 8, "output_tokens": 8},
    "steps": [{"name": "peak", "rate": 2, "duration": "10s", "criteria": {"e2e_p99_s": 5}}],
    "neighbour": {"memory": "96MiB", "during": "peak", "start_after": "4s", "hold": "5s", "criteria": CRITERIA},
}


def _sample(t: float) -> TargetSample:
    """Before t=4: 200 MiB resident (80 MiB of it mapped weights), 2 major faults/s, 1 % stall. From t=4 the
    neighbour holds: 120 MiB resident, 20 MiB mapped, 150 faults/s, 25 % stall."""
    if t < 4.0:
        return TargetSample(t, 200 * MiB, 80 * MiB, int(t * 2), 300 * MiB, int(t * 1e4), None)
    return TargetSample(t, 120 * MiB, 20 * MiB, 8 + int((t - 4) * 150), 220 * MiB, 40_000 + int((t - 4) * 25e4), 96 * MiB)


def _report() -> GateReport:
    spec = parse_spec(DOC, source="gate.yaml")
    assert spec.neighbour is not None
    step = spec.steps[0]
    load = StepLoad(step=step, t0=0.0, wall0=T0, load_end=10.0, end=10.5)
    for k in range(20):
        at = k * 0.5
        e2e = 0.9 if 4.0 <= at < 9.0 else 0.2  # 4.5x slower during the hold, still under its 1 s bound
        load.results.append(Result(scheduled=at, sent=at, done=at + e2e, status=200, output_tokens=8))
    target = TargetGroup("/llm/service", Path("/nonexistent/llm/service"), "v1", None)
    run = NeighbourRun(spec.neighbour, target, "/llm/llmdiag-neighbour-1", 100 * MiB, None, start=4.0, ready=4.5,
                       stop=9.0, oom_before=0, oom_after=0)  # fmt: skip
    run.samples = [_sample(i / 4) for i in range(42)]
    outcome = judge_neighbour(run, load, 0)
    outcome.primary = "thrashing"
    outcome.diagnosis = "thrashing: the service's mapped weights were evicted and faulted back in"
    report = GateReport(spec, "http://127.0.0.1:8000")
    facts = HostFacts(3.0, "host", 0)
    analysis = Analysis("thrashing", [], [], [], (T0, T0 + 11))
    report.steps.append(StepReport(step, load, judge(load, step.criteria, facts), facts, analysis))
    report.neighbour = outcome
    return report


@pytest.mark.process
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (apt-get install -y --no-install-recommends chromium)")
def test_the_neighbour_section_renders_its_verdict_and_the_services_memory_before_and_during(tmp_path: Path) -> None:
    report = _report()
    nb = report.neighbour
    assert nb is not None and nb.state == "FAIL"
    page = tmp_path / "gate.html"
    page.write_text(render_html(report, None, argv=["diag", "gate"]))
    dom, console = chromium(page, "--dump-dom", profile=tmp_path / "profile")
    assert console == [], console
    assert "GATE FAILED: neighbour (during peak)" in dom  # the verdict names the check that broke
    section = re.search(r'<h2 id="neighbour">.*?(?=<h2 id="measured">)', dom, re.S)
    assert section, "no neighbour section"
    html = section.group(0)
    assert re.search(r'Neighbour during peak: <span class="bad">FAIL</span>', html)
    # each criterion: its result, the figure measured, the limit
    rows = {m.group(1): m.group(0) for m in re.finditer(r'<tr id="neighbour-([a-z0-9_]+)">.*?</tr>', html, re.S)}
    assert set(rows) == {"e2e_p99_s", "max_latency_ratio", "max_target_reclaimed_ratio", "oom_kills"}
    assert 'class="bad">FAIL</td><td class="num">0.400</td><td class="num">&lt;= 0.1</td>' in rows["max_target_reclaimed_ratio"]
    assert 'class="bad">FAIL</td><td class="num">4.50x</td>' in rows["max_latency_ratio"]
    assert 'class="ok">PASS</td><td class="num">900 ms</td>' in rows["e2e_p99_s"]
    assert 'class="ok">PASS</td><td class="num">0</td>' in rows["oom_kills"]
    # the setup: the hog, the service's protection, the shared parent
    assert "96.0 MiB touched in <code>/llm/llmdiag-neighbour-1</code> (hard limit 100.0 MiB)" in html
    assert "ready 500 ms after its start, held 4.5 s" in html and "its group's usage at the peak 96.0 MiB" in html
    assert "Protection of <code>/llm/service</code>: cgroup v1: no hard protection" in html
    assert "Shared parent <code>/llm</code>: limit unlimited" in html
    # the service's memory: before (median) and during (lowest), faults and stall as rates
    memory = re.search(r'<table class="neighbour-memory">.*?</table>', html, re.S)
    assert memory
    cells = [re.sub(r"<[^>]+>", "", r).strip() for r in re.findall(r"<tr>(.*?)</tr>", memory.group(0), re.S)]
    rss = r"resident memory of the service's processes \(RSS\)\s*200\.0 MiB\s*120\.0 MiB"
    assert any(re.search(rss, c) for c in cells), cells
    assert any(re.search(r"file-backed resident memory \(mapped weights\)\s*80\.0 MiB\s*20\.0 MiB", c) for c in cells), cells
    faults = nb.facts["major_faults_per_s"]
    assert faults["before"] < 3 < 140 < faults["during"]  # the neighbour's doing, as put in
    assert any(re.search(rf"major page faults\s*{faults['before']:.1f}/s\s*{faults['during']:.1f}/s", c) for c in cells)
    assert any(re.search(r"memory stall of the service's group \(PSI some\)\s*1\.0 %\s*25\.0 %", c) for c in cells), cells
    assert re.search(r'OOM kills in the service during the hold: <strong class="ok">0</strong>', html)
    assert "Diagnosis of the step it ran in: <strong>thrashing</strong>" in html and "mapped weights were evicted" in html


def test_a_neighbour_not_run_says_why_and_the_gate_does_not_pass() -> None:
    report = _report()
    assert report.spec.neighbour is not None
    report.neighbour = not_run(report.spec.neighbour, "needs root to create a memory cgroup beside the service's")
    report.steps[0].verdicts = [v for v in report.steps[0].verdicts if v.passed]
    html = render_html(report, None, argv=["diag", "gate"])
    section = re.search(r'<h2 id="neighbour">.*?(?=<h2 id="measured">)', html, re.S)
    assert section and 'Neighbour during peak: <span class="dim">NOT RUN</span>' in section.group(0)
    assert "needs root to create a memory cgroup" in section.group(0) and "does not pass on a check it did not make" in html
    assert "neighbour-memory" not in section.group(0) and "OOM kills in the service" not in section.group(0)
    assert "GATE NOT PASSED: the neighbour check was NOT RUN" in html


def test_without_a_neighbour_in_the_spec_there_is_no_section() -> None:
    report = _report()
    report.spec = parse_spec({k: v for k, v in DOC.items() if k != "neighbour"}, source="gate.yaml")
    report.neighbour = None
    assert 'id="neighbour"' not in render_html(report, None, argv=["diag", "gate"])
