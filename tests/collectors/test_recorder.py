"""The flight recorder: round trips, retention and size bounds, concurrent writers, kill -9 safety."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder, RecorderWriter, default_recorder_path
from collectors.records import HostSnapshot, Psi, PsiLine, RequestTiming


def _host(ts: float, i: int = 0) -> HostSnapshot:
    return HostSnapshot(
        ts=ts,
        psi={"memory": Psi(some=PsiLine(1.5, 0.5, 0.1, 1000 + i))},
        memory={"total": 8 << 30, "available": 4 << 30},
        vmstat={"pgmajfault": i, "pswpin": 0},
    )


def test_round_trip_in_time_order(tmp_path: Path) -> None:
    now = time.time()
    with FlightRecorder(tmp_path / "r.db") as rec:
        rec.write([_host(now + 2, 2), _host(now, 0), RequestTiming(ts=now + 1, arrival=now, start=now + 0.5, finish=now + 1)])
        got = list(rec.read())
        assert [r.ts for r in got] == sorted(r.ts for r in got)
        assert got[0] == _host(now, 0)
        assert isinstance(got[1], RequestTiming) and got[1].queue_wait_s == pytest.approx(0.5)
        assert [r.KIND for r in rec.read(kinds=["host"], since=now + 1)] == ["host"]
        assert rec.count("host") == 2 and rec.count() == 3


def test_retention_drops_only_old_rows(tmp_path: Path) -> None:
    now = time.time()
    with FlightRecorder(tmp_path / "r.db", retention_s=3600) as rec:
        rec.write(_host(now - 7200 + i, i) for i in range(100))  # two hours ago
        rec.write(_host(now - 60 + i, i) for i in range(50))  # the last minute
        result = rec.trim(now)
        assert result.deleted_by_age == 100
        assert rec.count() == 50
        assert min(r.ts for r in rec.read()) >= now - 3600


def test_size_bound_holds_and_keeps_the_newest(tmp_path: Path) -> None:
    limit = 1 << 20
    now = time.time()
    path = tmp_path / "r.db"
    with FlightRecorder(path, retention_s=10 * 86400, max_size_bytes=limit) as rec:
        for batch in range(10):  # ~10 MiB written in all, far over the bound
            rec.write(_host(now - 100_000 + batch * 5000 + i, i) for i in range(5000))
            rec.trim(now)
            on_disk = sum(os.path.getsize(f"{path}{s}") for s in ("", "-wal") if os.path.exists(f"{path}{s}"))
            assert on_disk <= limit, f"batch {batch}: {on_disk} bytes on disk > {limit}"
        newest = max(r.ts for r in rec.read())
        assert newest == pytest.approx(now - 100_000 + 9 * 5000 + 4999)
        assert rec.count() > 1000  # trimming is proportional, it does not empty the recorder
        assert rec.integrity_ok()


def test_background_writer_never_blocks_and_counts_drops(tmp_path: Path) -> None:
    writer = RecorderWriter(tmp_path / "r.db", max_queue=10, flush_interval_s=60)
    now = time.time()
    accepted = sum(writer.submit(RequestTiming(ts=now, arrival=now, finish=now)) for _ in range(100))
    assert accepted + writer.dropped == 100 and writer.dropped > 0
    writer.close()
    with FlightRecorder(tmp_path / "r.db") as rec:
        assert rec.count("request") == accepted


def test_writer_survives_an_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = RecorderWriter(blocker / "sub" / "r.db", flush_interval_s=0.05)
    assert writer.submit(RequestTiming(ts=1.0, arrival=1.0, finish=1.0))
    assert writer.flush(5)
    writer.close()
    assert writer.write_errors >= 1 and writer.written == 0


def test_default_path_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMDIAG_RECORDER", str(tmp_path / "x.db"))
    assert default_recorder_path() == tmp_path / "x.db"
    monkeypatch.delenv("LLMDIAG_RECORDER")
    assert default_recorder_path().name == "recorder.db"
    monkeypatch.setenv("LLMDIAG_STATE_DIR", str(tmp_path / "state"))
    assert default_recorder_path() == tmp_path / "state" / "recorder.db"


def test_root_and_users_share_the_units_state_directory_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Root finds what the systemd units write (/var/lib/llm-diag); a user keeps the XDG state dir."""
    from collectors import recorder
    from diag.cli.triage import default_db_path

    for name in ("LLMDIAG_RECORDER", "LLMDIAG_STATE_DIR", "LLMDIAG_TRIAGE_DB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(recorder.os, "geteuid", lambda: 0)
    assert default_recorder_path() == Path("/var/lib/llm-diag/recorder.db")
    assert default_db_path() == Path("/var/lib/llm-diag/triage.db")
    monkeypatch.setattr(recorder.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_recorder_path() == tmp_path / "xdg" / "llm-diag" / "recorder.db"
    assert default_db_path() == tmp_path / "xdg" / "llm-diag" / "triage.db"


_WRITER = textwrap.dedent(
    """
    import sys, time
    from collectors.recorder import FlightRecorder
    from collectors.records import HostSnapshot
    trim_each = sys.argv[2] == "trim"
    rec = FlightRecorder(sys.argv[1], retention_s=3600, max_size_bytes=64 << 20)
    i = 0
    while True:
        now = time.time()
        rows = [HostSnapshot(ts=now, memory={"total": i}, vmstat={"pgmajfault": i}) for _ in range(500)]
        if trim_each:  # rows past the retention, so every trim deletes, vacuums and checkpoints for real
            rows += [HostSnapshot(ts=now - 7200, memory={"total": -1}) for _ in range(500)]
        rec.write(rows)
        i += 1
        print(i, flush=True)  # committed: the transaction above returned
        if trim_each or i % 7 == 0:
            rec.trim()
            print("trimmed", flush=True)
    """
)


@pytest.mark.process
@pytest.mark.parametrize("round_", range(3))
@pytest.mark.parametrize("during", ["write", "trim"])
def test_kill_9_mid_write_or_trim_loses_nothing_committed(tmp_path: Path, round_: int, during: str) -> None:
    path = tmp_path / "r.db"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), during], stdout=subprocess.PIPE, text=True)
    committed = 0
    try:
        assert proc.stdout is not None
        target = 5 + 4 * round_
        for line in proc.stdout:
            if line.strip().isdigit():
                committed = int(line)
            elif during == "trim" and committed >= target:
                break  # a trim just finished: the next write and trim are under way
            if during == "write" and committed >= target:
                break
        time.sleep(0.013 * (round_ + 1))  # land somewhere inside a later transaction (or trim)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    with FlightRecorder(path) as rec:  # the next start recovers the WAL
        assert rec.integrity_ok()
        new = rec._db.execute("SELECT COUNT(*) FROM records WHERE json_extract(body, '$.memory.total') >= 0").fetchone()[0]
        assert new >= committed * 500, "a committed sample was lost"
        assert new % 500 == 0, "a transaction is all or nothing"
        assert sum(1 for _ in rec.read()) == rec.count()


@pytest.mark.process
def test_kill_9_of_the_agent_loses_no_committed_sample_and_the_next_start_recovers(tmp_path: Path) -> None:
    recorder = tmp_path / "r.db"
    argv = [sys.executable, "-m", "diag.cli", "collect", "--interval", "50ms", "--listen", "off", "--recorder",
            str(recorder), "--no-gpu", "--no-kmsg", "--verbose"]  # fmt: skip
    agent = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    written = 0
    try:
        assert agent.stderr is not None
        for line in agent.stderr:
            match = re.search(r"sample (\d+) written", line)
            if match:
                written = int(match.group(1))  # logged after the sample's transaction committed
                if written >= 15:
                    break
    finally:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
    restart = subprocess.run([*argv[:-1], "--samples", "3"], capture_output=True, text=True, timeout=60)
    assert restart.returncode == 0, restart.stderr
    assert "moved it to" not in restart.stderr  # recovered, not set aside
    with FlightRecorder(recorder, readonly=True) as rec:
        assert rec.integrity_ok()
        assert rec.count("host") >= written + 3
