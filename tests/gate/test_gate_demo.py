"""``diag gate`` against the reference backend (``diag demo serve``) with one inference slot, for real.

- The shipped example (``docs/gate-example.yaml``, run as written) passes: every step within its criteria.
- The same steps with the peak raised past what one slot serves fail that peak on its p99, and the rules'
  diagnosis of the peak's window is the queue backlog -- requests waiting for the slot, not slow inference.

The service writes its request rows into the flight recorder the gate's agent writes (``--recorder``), as an
instrumented service on a host running ``diag collect`` does; the agent also scrapes its /metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from diag.demo.harness import DemoServer, start_demo
from tests.paths import REPO

pytestmark = [pytest.mark.process, pytest.mark.slow]
EXAMPLE = REPO / "docs" / "gate-example.yaml"


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoServer, Path]]:
    tmp = tmp_path_factory.mktemp("gate-demo")
    rec = tmp / "recorder.db"
    args = ["--max-concurrency", "1", "--queue-size", "512", "--queue-timeout", "60"]
    srv = start_demo(args, weights_mb=16, weights_dir=tmp / "w", log_dir=tmp, recorder=rec)
    try:
        yield srv, rec
    finally:
        srv.stop()


def _gate(spec: Path, srv: DemoServer, rec: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    argv = [sys.executable, "-m", "diag.cli", "gate", "--spec", str(spec), "--target", srv.url]
    argv += ["--pid", str(srv.pid), "--recorder", str(rec), "--json", str(out)]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    print(run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    return run, json.loads(out.read_text())


def test_the_example_spec_passes_on_one_slot(one_slot: tuple[DemoServer, Path], tmp_path: Path) -> None:
    srv, rec = one_slot
    run, doc = _gate(EXAMPLE, srv, rec, tmp_path / "gate.json")
    assert run.returncode == 0, run.stdout
    assert doc["passed"] and not doc["not_run"]
    assert [s["name"] for s in doc["steps"]] == ["idle", "normal", "peak", "concurrent", "recovery"]
    for step in doc["steps"]:
        assert step["passed"] and step["criteria"] and all(c["passed"] for c in step["criteria"]), step
        assert step["measured"]["errors"] == 0 and step["measured"]["sent"] > 0
    peak = doc["steps"][2]["measured"]
    assert 8 * 0.5 < peak["achieved_rps"] < 8 * 1.6  # Poisson at 8/s over 12 s
    assert "GATE PASSED: 5 steps" in run.stdout


def test_a_peak_past_one_slot_fails_on_p99_with_a_queue_backlog(one_slot: tuple[DemoServer, Path], tmp_path: Path) -> None:
    srv, rec = one_slot
    doc = yaml.safe_load(EXAMPLE.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    steps["peak"]["rate"] = 40  # one slot serves ~25 requests/s of these here: the queue grows for 10 s
    steps["peak"]["duration"] = "10s"
    steps["peak"]["criteria"].pop("drain_s")  # a grown queue takes what it takes to drain; p99 is the criterion here
    doc["steps"] = [steps["normal"], steps["peak"], steps["recovery"]]
    spec = tmp_path / "overload.yaml"
    spec.write_text(yaml.safe_dump(doc))
    run, out = _gate(spec, srv, rec, tmp_path / "gate.json")
    assert run.returncode == 1, run.stdout
    normal, peak, _recovery = out["steps"]
    assert normal["passed"] and not peak["passed"] and not out["passed"]
    failed = [c["criterion"] for c in peak["criteria"] if not c["passed"]]
    assert failed == ["e2e_p99_s"], peak["criteria"]
    assert peak["measured"]["e2e_p99_s"] > 2 and peak["measured"]["errors"] == 0
    assert peak["diagnosis"]["primary"] == "queue_backlog", peak["diagnosis"]
    assert "peak: e2e_p99_s" in run.stdout and "peak: diagnosis -- queue_backlog:" in run.stdout
    assert "GATE FAILED: peak" in run.stdout
