"""The verdict's words say why an analysis is ``inconclusive``: suspects, too little data, both, or neither.

The engine records two causes for ``inconclusive`` -- findings that reached only the suspect level, and rules
that could not judge because the window was too short -- and the terminal view, the bundle's reports and the
bundle's stdout line must name the cause the analysis actually reported. A headline that points at suspects
when there are none (a recorder with two samples) sent readers looking for something that was not there.

The analyses are real: committed scenario recordings through the rules, cut the way a short window or a
service without the request tracker cuts them; the ``diag analyze`` case runs the real agent for two samples.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from diag.bundle.report import ReportData, render_html, render_markdown
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import Analysis, analyze
from diag.timeline import timeline_from_records
from diag.views.analysis import PLAIN, render_analysis, verdict_headline
from tests.paths import FIXTURES

SCENARIOS = FIXTURES / "scenarios"


def _records(name: str) -> list[dict]:
    return read_jsonl_gz(SCENARIOS / f"{name}.jsonl.gz")


def _first_seconds(records: list[dict], seconds: float) -> list[dict]:
    start = min(r["ts"] for r in records)
    return [r for r in records if r["ts"] < start + seconds]


def _analysis(case: str) -> Analysis:
    """A real analysis whose ``inconclusive`` has exactly the named cause(s)."""
    if case == "too_little_only":  # the healthy run's first 3 s: nothing found, the window too short
        return analyze(timeline_from_records(_first_seconds(_records("healthy"), 3), source="healthy, first 3 s"))
    if case == "suspects_only":  # an unsafe configuration, no request tracker: a suspect, nothing short of data
        records = [r for r in _records("unsafe-config") if r["kind"] != "request"]
        return analyze(timeline_from_records(records, source="unsafe-config, no request rows"))
    if case == "both":  # the same configuration's first 10 s: the suspect and rules short of data
        return analyze(timeline_from_records(_first_seconds(_records("unsafe-config"), 10), source="unsafe-config, 10 s"))
    assert case == "neither"  # the engine does not produce it; a document from elsewhere may: the words stay true
    return Analysis("inconclusive", [], [], [], (0.0, 1.0), source="hand-made")


CASES = ["too_little_only", "suspects_only", "both", "neither"]


@pytest.fixture(scope="module")
def analyses() -> dict[str, Analysis]:
    out = {case: _analysis(case) for case in CASES}
    shape = {case: (a.primary, bool(a.suspects), bool(a.too_little_data)) for case, a in out.items()}
    assert shape == {  # the cases are what their names say (else the fixtures changed under the test)
        "too_little_only": ("inconclusive", False, True),
        "suspects_only": ("inconclusive", True, False),
        "both": ("inconclusive", True, True),
        "neither": ("inconclusive", False, False),
    }
    return out


def _terminal(analysis: Analysis) -> str:
    console = Console(record=True, width=400, file=io.StringIO())
    render_analysis(analysis, console)
    return console.export_text()


@pytest.mark.parametrize("case", CASES)
def test_the_headline_names_only_the_causes_reported(analyses: dict[str, Analysis], case: str) -> None:
    a = analyses[case]
    words = verdict_headline(a.primary, a.suspects, a.too_little_data)
    assert words.startswith("Inconclusive:")
    assert ("suspect" in words) == bool(a.suspects), words
    assert ("too little data" in words) == bool(a.too_little_data), words
    if a.suspects:
        assert f"{len(a.suspects)} suspect" in words
    for short in a.too_little_data:
        assert short["rule"] in words  # which rules could not judge
    if not a.suspects and not a.too_little_data:
        assert "no cause" in words


@pytest.mark.parametrize("case", CASES)
def test_the_terminal_lists_what_the_headline_announces(analyses: dict[str, Analysis], case: str) -> None:
    a = analyses[case]
    text = _terminal(a)
    lines = text.splitlines()
    assert lines[0] == "Verdict: inconclusive"
    assert lines[1] == verdict_headline(a.primary, a.suspects, a.too_little_data)
    assert sum(line.startswith("Suspect: ") for line in lines) == len(a.suspects)
    shorts = [line for line in lines if line.startswith("Too little data for ")]
    assert len(shorts) == len(a.too_little_data)
    for line, short in zip(shorts, a.too_little_data, strict=True):
        assert short["have"] in line and short["needed"] in line


@pytest.mark.parametrize("case", CASES)
def test_the_bundle_reports_say_the_same(analyses: dict[str, Analysis], case: str) -> None:
    a = analyses[case]
    doc = json.loads(json.dumps(a.to_dict(), default=str))  # findings.json as the bundle writes it
    data = ReportData(
        bundle_name="b", host="h", created=time.time(), window=a.window, since_s=1800, version="t", command="diag bundle",
        analysis=doc, analysis_error=None, runs=[], redaction={"total": 0, "rules": {}},
        self_cgroup={"inside": None, "before": "/"}, record_counts={},
    )  # fmt: skip
    headline = verdict_headline(a.primary, a.suspects, a.too_little_data)
    markdown = render_markdown(data)
    html, _ = render_html(data, None)
    assert headline in markdown and headline.replace("'", "&#39;") in html
    assert ("## Too little data" in markdown) == bool(a.too_little_data)
    assert ('id="too-little-data"' in html) == bool(a.too_little_data)
    for short in a.too_little_data:
        assert short["needed"] in markdown and short["rule"] in html


def test_a_named_verdict_keeps_its_plain_words() -> None:
    assert verdict_headline("memory_leak", [], [{"rule": "x"}]) == PLAIN["memory_leak"]
    assert verdict_headline("healthy") == PLAIN["healthy"]


@pytest.mark.process
def test_analyze_on_a_two_sample_recorder_says_it_had_too_little_data(tmp_path: Path) -> None:
    """The reported case: the real agent records two samples, ``diag analyze`` reads them."""
    recorder = tmp_path / "two.db"
    agent = subprocess.run(
        [sys.executable, "-m", "diag.cli", "collect", "--samples", "2", "--interval", "50ms", "--listen", "off",
         "--no-kmsg", "--no-gpu", "--recorder", str(recorder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert agent.returncode == 0, agent.stderr
    run = subprocess.run(
        [sys.executable, "-m", "diag.cli", "analyze", "--recorder", str(recorder)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    as_json = [sys.executable, "-m", "diag.cli", "analyze", "--recorder", str(recorder), "--json"]
    document = json.loads(subprocess.run(as_json, capture_output=True, text=True, timeout=120, check=True).stdout)["verdict"]
    assert document["too_little_data"]
    assert run.stdout.count("Too little data for ") == len(document["too_little_data"])
    headline = run.stdout.splitlines()[1]
    if document["primary"] != "inconclusive":
        # The agent sees the whole host: a finding that needs no history (two processes holding one model
        # file -- other tests' servers, when the suite runs in parallel) is a real verdict, named as such.
        assert document["primary"] in run.stdout, run.stdout
        return
    assert "too little data" in headline, run.stdout
    # Likewise a fault elsewhere on the host between the two samples is a suspect that needs no history: in
    # `make test` the live tier's groups hit their limits beside this test (measured in a CI: another test's group,
    # failcnt +7602 in 50 ms, a memory_pressure suspect at 0.45). Then the headline names both reasons; otherwise
    # it must not point at suspects that are not there.
    assert ("suspect" in headline) == bool(document["suspects"]), run.stdout
    assert all(short["rule"] in headline for short in document["too_little_data"])
