"""``diag gate``'s command line: bad input is refused before any load, in one line naming the option or the
spec's field, exit 2; a target nobody answers at is refused the same way; Ctrl-C stops the load and still
prints the table of the steps that ran."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
import yaml
from typer.testing import CliRunner

from diag.cli.main import app
from tests.gate.stubproc import stub_server
from tests.paths import REPO

STEP = {"prompt_tokens": 4, "output_tokens": 4}


def _spec(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--target", "http://10.1.2.3:8000"], "--target 'http://10.1.2.3:8000': not a loopback address"),
        (["--target", "ftp://127.0.0.1"], "--target 'ftp://127.0.0.1': an http(s) base URL"),
        (["--target", "http://127.0.0.1:8000", "--pid", "0"], "--pid 0: a process id is a positive number"),
        (["--target", "http://127.0.0.1:8000", "--cgroup", "a/../b"], "--cgroup 'a/../b'"),
        (["--target", "http://127.0.0.1:8000", "--json", "/"], "--json /: is a folder"),
    ],
)
def test_bad_options_are_refused_before_any_load(tmp_path: Path, args: list[str], says: str) -> None:
    spec = _spec(tmp_path, {"steps": [{"rate": 1, "duration": 1, **STEP}]})
    result = CliRunner().invoke(app, ["gate", "--spec", str(spec), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_a_bad_spec_names_its_field_and_a_missing_one_its_path(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"steps": [{"rate": 1, "duration": "1 fortnight", **STEP}]})
    result = CliRunner().invoke(app, ["gate", "--spec", str(spec), "--target", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert f"--spec {spec}: steps[0].duration: got '1 fortnight'; expected a duration" in result.output
    result = CliRunner().invoke(app, ["gate", "--spec", str(tmp_path / "nope.yaml"), "--target", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "--spec" in result.output and "no such file" in result.output


@pytest.mark.process
def test_a_target_that_does_not_answer_is_bad_input(tmp_path: Path) -> None:
    from tests.promserver import free_port

    spec = _spec(tmp_path, {"steps": [{"rate": 1, "duration": 1, **STEP}]})
    port = free_port()  # bound and released: nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "diag.cli", "gate", "--spec", str(spec), "--target", f"http://127.0.0.1:{port}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert f"--target http://127.0.0.1:{port}: nothing answers there" in out.stderr and "Traceback" not in out.stderr


class _Lines:
    """A process's stderr read by a thread, so the test can wait for a line with a deadline and still get the rest."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return
        raise AssertionError(f"no line with {text!r} in {timeout_s} s: {''.join(self.seen)}")

    def rest(self) -> str:
        self._thread.join(10)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)


@pytest.mark.process
def test_ctrl_c_stops_the_load_and_prints_what_ran(tmp_path: Path) -> None:
    doc = {
        "steps": [
            {"name": "first", "rate": 5, "duration": 2, **STEP, "criteria": {"error_ratio": 0}},
            {"name": "long", "rate": 5, "duration": 60, **STEP},
            {"name": "never", "rate": 5, "duration": 60, **STEP},
        ]
    }
    spec = _spec(tmp_path, doc)
    with stub_server("--delay", "0.05") as stub:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diag.cli",
                "gate",
                "--spec",
                str(spec),
                "--target",
                stub.url,
                "--json",
                str(tmp_path / "out.json"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None and proc.stdout is not None
            progress = _Lines(proc.stderr)
            progress.wait_for("[2/3] long:", 60)
            t_sig = time.monotonic()
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(30)
            stopped_in = time.monotonic() - t_sig
            out, err = proc.stdout.read(), progress.rest()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        sent = len(stub.stats()["received"])
    assert proc.returncode == 1, (out, err)
    assert stopped_in < 10 and "Traceback" not in err
    assert re.search(r"^first +PASS", out, re.M) and re.search(r"^long +INTERRUPTED", out, re.M)
    assert re.search(r"^never +NOT RUN", out, re.M) and "[2/3] long: INTERRUPTED" in err
    assert "GATE NOT PASSED: interrupted after 2 of 3 steps" in out
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["interrupted"] and doc["exit_code"] == 1 and doc["not_run"] == ["never"]
    assert [s["name"] for s in doc["steps"]] == ["first", "long"] and doc["steps"][1]["interrupted"]
    assert sent < 5 * 2 + 5 * 20  # the long step's load stopped well before its 60 s
