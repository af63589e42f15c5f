"""`diag collect` and `diag snapshot` end to end: real subprocesses, real HTTP on loopback, fixtures from node_exporter."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from collectors.catalog import CATALOG, MEMINFO_FIELDS
from collectors.recorder import FlightRecorder
from tests.paths import EXTERNAL

FIXTURES = EXTERNAL
NODE_EXPORTER = FIXTURES / "node_exporter"
DIAG = [sys.executable, "-m", "diag.cli"]
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def _parse_exposition(text: str) -> dict[str, float]:
    """Unlabelled samples by name (labelled ones keyed name{labels})."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_RE.match(line)
        assert match, f"not an exposition line: {line!r}"
        out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def _expected() -> dict[str, float]:
    return _parse_exposition((NODE_EXPORTER / "expected_metrics.prom").read_text())


@pytest.fixture(scope="module")
def once_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    empty_sys = tmp_path_factory.mktemp("sys")
    proc = subprocess.run(
        [*DIAG, "collect", "--once", "--no-gpu", "--proc-root", str(NODE_EXPORTER / "proc"), "--sys-root", str(empty_sys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_once_matches_node_exporter_pressure(once_output: str) -> None:
    ours, theirs = _parse_exposition(once_output), _expected()
    pairs = {
        "llmdiag_host_pressure_cpu_waiting_seconds_total": "node_pressure_cpu_waiting_seconds_total",
        "llmdiag_host_pressure_io_waiting_seconds_total": "node_pressure_io_waiting_seconds_total",
        "llmdiag_host_pressure_io_stalled_seconds_total": "node_pressure_io_stalled_seconds_total",
        "llmdiag_host_pressure_memory_waiting_seconds_total": "node_pressure_memory_waiting_seconds_total",
        "llmdiag_host_pressure_memory_stalled_seconds_total": "node_pressure_memory_stalled_seconds_total",
    }
    for mine, node in pairs.items():
        assert ours[mine] == pytest.approx(theirs[node], rel=1e-12), mine


def test_once_matches_node_exporter_meminfo_and_vmstat(once_output: str) -> None:
    ours, theirs = _parse_exposition(once_output), _expected()
    assert ours["llmdiag_host_memory_total_bytes"] == theirs["node_memory_MemTotal_bytes"]
    compared = 0
    for key, snake in MEMINFO_FIELDS.items():
        node_name = "node_memory_" + key.replace("(", "_").replace(")", "") + "_bytes"
        if node_name in theirs:
            assert ours[f"llmdiag_host_memory_{snake}_bytes"] == theirs[node_name], key
            compared += 1
    assert compared >= 20
    vmstat = {k.removeprefix("node_vmstat_"): v for k, v in theirs.items() if k.startswith("node_vmstat_")}
    assert len(vmstat) >= 7
    for field, value in vmstat.items():
        assert ours[f"llmdiag_host_vmstat_{field}_total"] == value, field


def test_every_exported_name_is_in_the_catalog(once_output: str) -> None:
    names = {key.split("{", 1)[0] for key in _parse_exposition(once_output)}
    assert names, "nothing exported"
    unknown = sorted(n for n in names if n not in CATALOG)
    assert not unknown, f"metric names spelled outside the catalog: {unknown}"


def test_bad_arguments_fail_with_a_clear_message(tmp_path: Path) -> None:
    cases = [
        (["collect", "--interval", "soon"], "not a duration"),
        (["collect", "--listen", "localhost"], "HOST:PORT"),
        (["collect", "--max-size", "lots", "--recorder", str(tmp_path / "r.db")], "not a size"),
        (["snapshot", "--proc-root", str(tmp_path)], "is this a /proc tree"),
    ]
    for args, message in cases:
        proc = subprocess.run([*DIAG, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_snapshot_json_on_this_host() -> None:
    proc = subprocess.run([*DIAG, "snapshot", "--json", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["host"]["kind"] == "host" and doc["host"]["memory"]["total"] > 0
    assert doc["gpu"]["available"] in (True, False)
    if not doc["gpu"]["available"]:
        assert doc["gpu"]["reason"]
    assert any(p["pid"] == os.getpid() for p in doc["processes"]), "a --pid process is always listed"


def test_snapshot_table_renders() -> None:
    proc = subprocess.run([*DIAG, "snapshot"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for heading in ("Host memory", "Pressure", "Processes"):
        assert heading in proc.stdout


def test_agent_serves_records_and_stops_cleanly(tmp_path: Path) -> None:
    recorder = tmp_path / "r.db"
    proc = subprocess.Popen(
        [*DIAG, "collect", "--interval", "200ms", "--listen", "127.0.0.1:0", "--recorder", str(recorder), "--no-gpu"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", banner)
        assert match, banner
        url = f"http://127.0.0.1:{match.group(1)}/metrics"
        deadline = time.monotonic() + 20
        body = ""
        while time.monotonic() < deadline:
            body = httpx.get(url, timeout=5).text
            if "llmdiag_host_memory_total_bytes" in body:
                break
            time.sleep(0.1)
        metrics = _parse_exposition(body)
        assert metrics["llmdiag_host_memory_total_bytes"] > 0
        assert metrics["llmdiag_agent_resident_memory_bytes"] > 0
        time.sleep(1.0)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=15)
    assert code == 0
    with FlightRecorder(recorder, readonly=True) as rec:
        assert rec.integrity_ok()
        hosts = list(rec.read(kinds=["host"]))
        assert len(hosts) >= 3
        assert all(h.memory["total"] > 0 for h in hosts)
