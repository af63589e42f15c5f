"""``diag gate``'s bundle at the first failed step and its ``--html`` page, for real.

- One real failing run against the reference backend with one inference slot (``diag demo serve``), each model
  step paced to at least 5 ms (``--min-step-ms``, as ``test_gate_demo.py`` runs it) so the peak is past what the
  slot serves on any host: the gate takes one
  bundle after the peak fails -- before the next step, covering the run so far, named in the output and the
  JSON -- and a later failed step takes none; the page renders in headless Chromium without a console message,
  its table saying the peak failed on p99 and its four charts drawn.
- A bundle that cannot be written is a note; the gate's verdict and exit status stand; a Ctrl-C abandons it.
- ``--no-bundle`` takes none; a folder the bundle or the page cannot be written in is refused before any load.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from diag.cli.main import app
from diag.demo.harness import start_demo
from diag.gate.on_fail import take_bundle
from diag.gate.runner import RunOptions, run_gate
from diag.gate.spec import parse_spec
from tests.bundle.chromium import CHROMIUM, chromium
from tests.gate.stubproc import stub_server
from tests.paths import REPO

# One slot, a backlog that waits (never 429), each model step at least 5 ms: the slot's service rate has a ceiling
# no host exceeds, so the planned overload is one on an idle host as on a busy one.
STEP_FLOOR_MS = 5
ONE_SLOT = ["--max-concurrency", "1", "--queue-size", "4096", "--queue-timeout", "60", "--min-step-ms", str(STEP_FLOOR_MS)]
PEAK_OUTPUT = 32  # tokens: 33 paced steps, at least 0.165 s a request, at most ~6 a second
PEAK_RATE = 15.0  # requests/s for 2 s: 21 arrivals (seed 0), at most 12 served by its end: the last waits 1.5 s or more
STEP = {"prompt_tokens": 4, "output_tokens": 4}


def _gate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "diag.cli", "gate", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    print(run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    return run


def _spec(tmp_path: Path) -> Path:
    """warm passes, peak overloads the slot (its queue grows for 2 s), after fails an impossible bound."""
    crit = {"e2e_p99_s": 1, "error_ratio": 0}
    doc = {
        "request_timeout": "60s",  # the backlog's last requests wait long: they are slow, not lost
        "max_in_flight": 4096,
        "steps": [
            {"name": "warm", "rate": 2, "duration": "3s", "prompt_tokens": 16, "output_tokens": 8, "criteria": crit},
            {"name": "peak", "rate": PEAK_RATE, "duration": "2s", "prompt_tokens": 16, "output_tokens": PEAK_OUTPUT,
             "criteria": crit},
            {"name": "after", "rate": 2, "duration": "1s", "prompt_tokens": 16, "output_tokens": 8,
             "criteria": {"e2e_p99_s": 0.0001}},
        ],
    }  # fmt: skip
    spec = tmp_path / "gate.yaml"
    spec.write_text(yaml.safe_dump(doc))
    return spec


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (apt-get install -y --no-install-recommends chromium)")
def test_a_failed_step_takes_one_bundle_of_the_run_and_the_page_renders(tmp_path: Path) -> None:
    srv = start_demo(ONE_SLOT, weights_mb=16, weights_dir=tmp_path / "w", log_dir=tmp_path, recorder=None)
    out = tmp_path / "out"
    try:
        spec = _spec(tmp_path)
        run = _gate("--spec", str(spec), "--target", srv.url, "--pid", str(srv.pid), "--json", str(out / "gate.json"),
                    "--html", str(out / "gate.html"))  # fmt: skip
    finally:
        srv.stop()
    assert run.returncode == 1, run.stdout
    doc = json.loads((out / "gate.json").read_text())
    warm, peak, after = doc["steps"]
    assert not peak["passed"] and not after["passed"]
    assert [c["criterion"] for c in peak["criteria"] if not c["passed"]] == ["e2e_p99_s"]

    # one bundle, beside --json (the default), named in the output and the JSON, taken before the next step
    bundles = sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("llm-diag-bundle-"))
    assert [str(p) for p in bundles] == [doc["bundle"]], (bundles, doc["bundle"])
    assert doc["bundle_archive"] and Path(doc["bundle_archive"]).is_file()
    assert f"bundle: {doc['bundle']}" in run.stdout
    assert "peak: first failed step: taking a bundle" in run.stderr and "after: first failed" not in run.stderr
    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    window = manifest["window"]
    assert window["start"] <= warm["window"]["start"] + 1.0  # the run so far, from its start
    assert peak["window"]["end"] - 1.0 <= window["end"] <= after["window"]["start"]  # ... to the failed step's end
    assert (bundles[0] / "report.html").is_file() and (bundles[0] / "findings.json").is_file()

    # the page: rendered by a real browser, no console message, the table and the charts
    page = out / "gate.html"
    assert f"html: {page}" in run.stdout
    dom, console = chromium(page, "--dump-dom", profile=tmp_path / "profile")
    assert console == [], console
    assert "GATE FAILED: peak, after" in dom
    row = re.search(r'<tr id="step-peak">.*?</tr>', dom, re.S)
    assert row and re.search(r'class="bad"[^>]*>FAIL [\d.]+ (s|ms)<span class="limit">limit &lt;= 1.00 s', row.group(0))
    assert doc["bundle"] in dom
    for key in ("load", "latency", "psi", "memory"):
        figure = re.search(rf'<figure id="chart-{key}".*?</figure>', dom, re.S)
        assert figure and figure.group(0).count("<path") >= 3, f"chart {key} missing or empty"
    assert "step boundaries" in dom and f"pid {srv.pid}" in dom  # the target's own memory, not the host's


@pytest.mark.process
def test_a_bundle_that_cannot_be_written_is_a_note_and_the_verdict_stands(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the bundle's --out is a file: diag bundle refuses it after the step failed
    spec = parse_spec({"steps": [{"name": "only", "rate": 5, "duration": 1, **STEP, "criteria": {"e2e_p99_s": 0.0001}}]})
    with stub_server("--delay", "0.02") as stub:
        report = run_gate(spec, RunOptions(stub.url, tmp_path / "rec.db", bundle_dir=blocker))
    assert report.exit_code == 1 and not report.steps[0].passed  # failed on its criterion, as it would without a bundle
    assert report.bundle is not None and report.bundle.path is None
    assert report.to_dict()["bundle"] is None
    note = next(n for n in report.notes if "bundle not taken" in n)
    assert note.startswith("only: bundle not taken: --out") and "not a folder" in note, note


@pytest.mark.process
def test_a_ctrl_c_abandons_the_bundle_at_once(tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcome = take_bundle(tmp_path / "bundles", tmp_path / "rec.db", time.time(), cancelled=lambda: True)
    assert outcome.path is None and outcome.note == "bundle not taken: the run was interrupted while it was being written"
    assert time.monotonic() - t0 < 5  # killed at the first poll, not waited for until its deadline
    assert not list(tmp_path.glob("bundles/llm-diag-bundle-*"))


@pytest.mark.process
def test_no_bundle_takes_none(tmp_path: Path) -> None:
    spec = tmp_path / "gate.yaml"
    spec.write_text(yaml.safe_dump({"steps": [{"rate": 5, "duration": 1, **STEP, "criteria": {"e2e_p99_s": 0.0001}}]}))
    with stub_server("--delay", "0.02") as stub:
        run = _gate("--spec", str(spec), "--target", stub.url, "--json", str(tmp_path / "out.json"), "--no-bundle",
                    "--bundle-dir", str(tmp_path / "bundles"), timeout=60)  # fmt: skip
    assert run.returncode == 1
    assert json.loads((tmp_path / "out.json").read_text())["bundle"] is None
    assert not (tmp_path / "bundles").exists() and not list(tmp_path.glob("llm-diag-bundle-*"))
    assert "bundle" not in run.stderr


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--bundle-dir", "--bundle-dir {p}: exists and is not a folder"),
        ("--html", "--html {p}: {f} is not a folder"),
    ],
)
def test_a_folder_that_cannot_be_written_is_refused_before_any_load(tmp_path: Path, option: str, says: str) -> None:
    spec = tmp_path / "gate.yaml"
    spec.write_text(yaml.safe_dump({"steps": [{"rate": 1, "duration": 1, **STEP}]}))
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker if option == "--bundle-dir" else blocker / "gate.html"
    # nothing listens on port 9 here: had the options not been checked first, the probe would refuse the target
    result = CliRunner().invoke(app, ["gate", "--spec", str(spec), "--target", "http://127.0.0.1:9", option, str(path)])
    assert result.exit_code == 2, result.output
    assert says.format(p=path, f=blocker) in result.output and "Traceback" not in result.output
    assert "nothing answers" not in result.output  # refused before the target was even probed
