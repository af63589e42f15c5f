"""`diag collect` and `diag snapshot` end to end: real subprocesses, real HTTP on loopback, fixtures from node_exporter."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from collectors.catalog import CATALOG, MEMINFO_FIELDS
from collectors.recorder import FlightRecorder
from tests.paths import EXTERNAL
from tests.procs import poll_until

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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_every_exported_name_is_in_the_catalog(once_output: str) -> None:
    names = {key.split("{", 1)[0] for key in _parse_exposition(once_output)}
    assert names, "nothing exported"
    unknown = sorted(n for n in names if n not in CATALOG)
    assert not unknown, f"metric names spelled outside the catalog: {unknown}"


@pytest.mark.process
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


def _invoke(args: list[str]) -> tuple[int, str]:
    """The real command in-process (the subprocess path is covered above): exit status and stderr."""
    from typer.testing import CliRunner

    from diag.cli.main import app

    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stderr


def test_every_option_is_checked_before_work_and_inapplicable_ones_are_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    bundle_dir = tmp_path / "bundle"
    (bundle_dir / "timeline").mkdir(parents=True)
    recorder = tmp_path / "never-created.db"
    cases = [
        # values: malformed or out of range, with the accepted forms in the message
        (["collect", "--retention", "abc", "--once"], "--retention: 'abc' is not a duration"),
        (["collect", "--retention", "abc", "--recorder", str(recorder)], "is not a duration"),
        (["collect", "--interval", "0", "--recorder", str(recorder)], "must be positive"),
        (["collect", "--max-size", "1KiB", "--recorder", str(recorder)], "at least 64KiB"),
        (["collect", "--max-size", "lots", "--recorder", str(recorder)], "use e.g. 64MiB, 256MiB"),
        (["collect", "--listen", "127.0.0.1:99999", "--recorder", str(recorder)], "port out of range"),
        (["collect", "--recorder", str(tmp_path)], "is a folder"),
        (["collect", "--recorder", str(a_file / "r.db")], "is not a folder"),
        (["collect", "--samples", "0", "--recorder", str(recorder)], "--samples 0: at least 1"),
        (["collect", "--retention", "5s", "--interval", "5s", "--recorder", str(recorder)], "keeps less than two samples"),
        (["collect", "--compact-every", "soon", "--recorder", str(recorder)], "use e.g. 30m, 1h or 6h, or off"),
        (["collect", "--compact-every", "0.5s", "--recorder", str(recorder)], "--compact-every 0.5s: at least 1s"),
        (["compact", "--recorder", str(tmp_path / "missing.db")], "no flight recorder at"),
        (["snapshot", "--pid", "0"], "a process id is a positive number"),
        (["snapshot", "--cgroup", "system.slice/../x"], "absolute path"),
        (["snapshot", "--sys-root", str(tmp_path / "nope")], "--sys-root"),
        (["snapshot", "--model-ext", "a/b"], "--model-ext"),
        (["analyze", "--recorder", str(tmp_path / "missing.db")], "no such file"),
        (["analyze", "--bundle", str(a_file)], "neither a bundle folder nor a .tar.gz/.tar bundle archive"),
        (["analyze", "--prometheus", "ftp://x"], "http(s) base URL"),
        (["analyze", "--since", "forever"], "not a duration"),
        (["bundle", "--deadline", "1s", "--out", str(tmp_path / "b1")], "--deadline 1s: at least 2s"),
        (["bundle", "--since", "yesterday", "--out", str(tmp_path / "b2")], "not a duration"),
        (["bundle", "--out", str(a_file)], "exists and is not a folder"),
        (["bundle", "--include", str(tmp_path / "nope.conf"), "--out", str(tmp_path / "b3")], "no such file"),
        (["bundle", "--unit", "vllm service; rm", "--out", str(tmp_path / "b4")], "systemd unit name"),
        (["bundle", "--pid", "-3", "--out", str(tmp_path / "b5")], "positive number"),
        # combinations: an option that cannot apply is refused, not ignored
        (["collect", "--once", "--retention", "1h"], "--retention cannot be used with --once"),
        (["collect", "--once", "--recorder", str(recorder), "--samples", "3"], "--recorder, --samples cannot be used"),
        (["collect", "--once", "--listen", "127.0.0.1:0"], "--listen cannot be used with --once"),
        (["collect", "--once", "--kmsg"], "--kmsg cannot be used with --once"),
        (["collect", "--once", "--interval", "5s"], "--interval cannot be used with --once"),
        (["collect", "--once", "--compact-every", "off"], "--compact-every cannot be used with --once"),
        (["analyze", "--bundle", str(bundle_dir), "--since", "2h"], "--since cannot be used with --bundle"),
        (["analyze", "--recorder", str(a_file), "--selector", 'job="x"'], "--selector cannot be used without --prometheus"),
        (["analyze", "--bundle", str(bundle_dir), "--prometheus", "http://127.0.0.1:1"], "give one of"),
    ]
    for args, message in cases:
        code, err = _invoke(args)
        assert code == 2, (args, code, err)
        assert message in " ".join(err.split()), (args, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # one clear line
    assert not recorder.exists(), "a refused command must not have created anything"
    assert not any((tmp_path / f"b{i}").exists() for i in (1, 2, 3, 4, 5)), "--out is created only once all is valid"


@pytest.mark.process
def test_bundle_creates_an_out_folder_that_does_not_exist_yet(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper"
    proc = subprocess.run([*DIAG, "bundle", "--out", str(out), "--no-gpu", "--no-tar", "--recorder", str(tmp_path / "none.db"),
                           "--since", "1m", "-q"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (root,) = out.iterdir()
    assert (root / "manifest.json").is_file() and f"Bundle: {root}" in proc.stdout


@pytest.mark.process
def test_snapshot_says_which_targets_do_not_exist_and_where_it_looked() -> None:
    proc = subprocess.run([*DIAG, "snapshot", "--no-gpu", "--pid", "999999", "--cgroup", "/nope"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # nothing asked for exists
    assert "pid 999999: no such process" in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "cgroup /nope" in x)
    assert "not found under" in line and ("v1 memory" in line or "cgroup2" in line)  # the hierarchies searched
    row = next(x for x in proc.stdout.splitlines() if x.strip().startswith("/nope"))
    assert "NOT FOUND" in row and "unlimited" not in row  # never a row that reads as "no limit"
    # one target that exists is enough for success; the missing one is still named
    ok = subprocess.run([*DIAG, "snapshot", "--no-gpu", "--json", "--pid", str(os.getpid()), "--cgroup", "/nope"],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    scope = json.loads(ok.stdout)["scope"]
    assert scope["resolved_pids"] == [os.getpid()] and scope["missing"][0].startswith("cgroup /nope: not found under")


@pytest.mark.process
def test_collect_warns_about_a_missing_target_once_and_records_the_watch_scope(tmp_path: Path) -> None:
    recorder = tmp_path / "r.db"
    proc = subprocess.run(
        [*DIAG, "collect", "--pid", "999999", "--cgroup", "/nope", "--samples", "4", "--interval", "50ms", "--listen",
         "off", "--recorder", str(recorder), "--no-gpu", "--no-kmsg"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # a service may start later: never a refusal
    assert proc.stderr.count("watch target not found (looking again every sample): pid 999999") == 1
    assert "stopped after 4 samples" in proc.stderr
    with FlightRecorder(recorder, readonly=True) as rec:
        (scope,) = list(rec.read(kinds=["watch_scope"]))  # written once: the resolution did not change
        assert rec.count("host") == 4
    assert scope.pids == [999999] and scope.cgroups == ["/nope"] and scope.resolved_pids == []
    assert any(m.startswith("pid 999999: no such process") for m in scope.missing)
    assert any(m.startswith("cgroup /nope: not found under") for m in scope.missing)
    once = subprocess.run([*DIAG, "collect", "--once", "--no-gpu", "--pid", "999999", "--pid", str(os.getpid())],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    metrics = _parse_exposition(once.stdout)
    assert metrics['llmdiag_watch_targets{kind="pid"}'] == 2 and metrics['llmdiag_watch_targets_found{kind="pid"}'] == 1


def _host_rows(path: Path) -> int:
    """Host samples committed in a recorder an agent is writing (0 while it is not created or not readable yet)."""
    try:
        with FlightRecorder(path, readonly=True) as rec:
            return rec.count("host")
    except (OSError, sqlite3.Error):
        return 0


@pytest.mark.process
def test_a_corrupt_recorder_is_named_by_analyze_and_set_aside_by_collect(tmp_path: Path) -> None:
    recorder = tmp_path / "recorder.db"
    junk = os.urandom(8192)
    recorder.write_bytes(junk)
    (tmp_path / "recorder.db-wal").write_bytes(b"stale wal")
    code = subprocess.run([*DIAG, "analyze", "--recorder", str(recorder)], capture_output=True, text=True, timeout=60)
    assert code.returncode == 2 and "Traceback" not in code.stderr
    assert f"{recorder} is not a readable flight recorder" in code.stderr and "Move it aside" in code.stderr
    proc = subprocess.Popen(
        [*DIAG, "collect", "--interval", "100ms", "--listen", "127.0.0.1:0", "--recorder", str(recorder), "--no-gpu",
         "--no-kmsg"], stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        moved = ""
        for line in proc.stderr:
            moved += line
            if "sampling every" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", moved)
        assert url and "moved it to" in moved, moved
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = _parse_exposition(httpx.get(url.group(0), timeout=5).text)
            if "llmdiag_host_memory_total_bytes" in metrics:
                break
            time.sleep(0.1)
        assert metrics['llmdiag_recorder_resets_total{reason="corrupt"}'] == 1
        assert poll_until(lambda: _host_rows(recorder) >= 2, 20), "the fresh recorder never got two host samples"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    (aside,) = [p for p in tmp_path.iterdir() if re.fullmatch(r"recorder\.db\.corrupt-\d{8}T\d{4}Z", p.name)]
    assert aside.read_bytes() == junk  # kept as it was
    assert (tmp_path / f"{aside.name}-wal").read_bytes() == b"stale wal"  # with its WAL, away from the fresh file
    with FlightRecorder(recorder, readonly=True) as rec:
        assert rec.integrity_ok() and rec.count("host") >= 2
    assert subprocess.run([*DIAG, "analyze", "--recorder", str(recorder)], capture_output=True, timeout=60).returncode == 0


@pytest.mark.process
def test_snapshot_json_on_this_host() -> None:
    proc = subprocess.run([*DIAG, "snapshot", "--json", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["host"]["kind"] == "host" and doc["host"]["memory"]["total"] > 0
    assert doc["gpu"]["available"] in (True, False)
    if not doc["gpu"]["available"]:
        assert doc["gpu"]["reason"]
    assert any(p["pid"] == os.getpid() for p in doc["processes"]), "a --pid process is always listed"


@pytest.mark.process
def test_snapshot_table_renders() -> None:
    proc = subprocess.run([*DIAG, "snapshot"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for heading in ("Host memory", "Pressure", "Processes"):
        assert heading in proc.stdout


@pytest.mark.process
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
        # A few committed samples, so the SIGTERM below lands on an agent that has been writing.
        assert poll_until(lambda: _host_rows(recorder) >= 3, 20), "the agent never recorded three host samples"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=15)
    assert code == 0
    with FlightRecorder(recorder, readonly=True) as rec:
        assert rec.integrity_ok()
        hosts = list(rec.read(kinds=["host"]))
        assert len(hosts) >= 3
        assert all(h.memory["total"] > 0 for h in hosts)
