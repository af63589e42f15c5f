"""``diag compact`` and ``diag collect --compact-every``, as shipped: real subprocesses on a recorder holding three
past hours. The command stores them and says so; the agent runs it itself as a nice-19 child and stops it with
itself; what reading through the stored hours gives is ``test_recorder_blocks.py``'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder
from collectors.records import HostSnapshot, RequestTiming
from diag.sources.blocks import BlockFile, blocks_path
from tests.procs import poll_until

DIAG = [sys.executable, "-m", "diag.cli"]
pytestmark = pytest.mark.process


def _past_hours(path: Path, hours: int = 3) -> float:
    """A recorder with a host row every 30 s and a request every 10 s over ``hours`` whole UTC hours and a bit, a day
    ago (long over, inside the retention used here); the first whole hour's start."""
    first = (time.time() // 3600 - 24) * 3600
    start = first - 600
    records: list[object] = []
    for k in range(int((hours * 3600 + 1200) / 10)):
        ts = start + 10 * k
        records.append(RequestTiming(ts=ts, arrival=ts - 0.5, start=ts - 0.4, finish=ts, outcome="ok", route="/v1/x"))
        if k % 3 == 0:
            records.append(HostSnapshot(ts=ts, memory={"total": 8 << 30, "available": (4 << 30) + k}))
    with FlightRecorder(path, retention_s=10 * 86400) as rec:
        rec.write(records)
    return first


def _priority(pid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:  # gone since it was listed
        return None


def _stored(recorder: Path) -> list[float]:
    store = BlockFile.open_for_reading(recorder)
    if store is None:
        return []
    try:
        return [b.lo for b in store.index()]
    finally:
        store.close()


def test_compact_stores_the_past_hours_and_says_so(tmp_path: Path) -> None:
    recorder = tmp_path / "r.db"
    first = _past_hours(recorder)
    run = subprocess.run([*DIAG, "compact", "--recorder", str(recorder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "4 hour(s) stored" in run.stderr and "0 still valid" in run.stderr, run.stderr  # 3 whole + the last part
    assert _stored(recorder) == [first + 3600 * k for k in range(4)]
    again = subprocess.run([*DIAG, "compact", "--recorder", str(recorder), "-q"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stderr == "", again.stderr


def test_compact_refuses_what_is_not_a_recorder(tmp_path: Path) -> None:
    missing = subprocess.run([*DIAG, "compact", "--recorder", str(tmp_path / "no.db")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no flight recorder at" in missing.stderr
    (tmp_path / "text.db").write_text("not sqlite\n" * 100)
    bad = subprocess.run([*DIAG, "compact", "--recorder", str(tmp_path / "text.db")], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a readable flight recorder" in bad.stderr and "Traceback" not in bad.stderr
    assert not blocks_path(tmp_path / "text.db").exists()


@pytest.mark.slow
def test_the_agent_stores_the_hours_itself_and_stops_its_child_with_it(tmp_path: Path) -> None:
    recorder = tmp_path / "r.db"
    first = _past_hours(recorder)
    agent = subprocess.Popen(
        [*DIAG, "collect", "--recorder", str(recorder), "--retention", "10d", "--compact-every", "1s", "--listen", "off",
         "--interval", "1s", "--no-gpu", "--no-kmsg", "-v"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def child_at_nice_19() -> bool:  # the compaction child, seen while it runs (it runs about once a second)
        kids = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        return 19 in [_priority(int(k)) for k in kids]

    try:
        assert poll_until(lambda: len(_stored(recorder)) == 4, timeout_s=60), "the agent stored no hour in 60 s"
        assert _stored(recorder)[0] == first
        assert poll_until(child_at_nice_19, timeout_s=30, every_s=0.02), "no compaction child seen at nice 19"
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert "storing the recorder's complete hours every 1s" in err
    # no run failed or outlived its deadline (one in flight at SIGTERM is stopped with the agent: every 1 s, one may be)
    assert "failed (exit" not in err and "(timeout" not in err, err
    children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
    assert children.stdout == ""  # nothing of it outlives the agent


def test_the_agents_compaction_is_hourly_by_default_and_off_when_asked(tmp_path: Path) -> None:
    from diag.cli.collect import _collect_plan

    def plan(every: str | None) -> float | None:
        return _collect_plan(None, "off", False, tmp_path / "r.db", None, None, None, None, compact_every=every).compact_every_s

    assert plan(None) == 3600.0 and plan("30m") == 1800.0 and plan("off") is None and plan("OFF") is None


def test_a_failed_run_that_printed_more_than_a_pipe_holds_is_reported_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that prints 256 KiB (four pipes' worth) and fails: its exit status comes back as soon as it exits --
    not a timeout, as when its stderr was a pipe read only after the exit (the child blocked on the full pipe) --
    and the end of what it printed, its error, is in the agent's log."""
    import threading

    from diag.live import compaction

    noisy = "import sys; sys.stderr.write('warning: row skipped\\n' * 12000); sys.stderr.write('the real error'); sys.exit(3)"
    monkeypatch.setattr(compaction, "command", lambda recorder: [sys.executable, "-c", noisy])
    caplog.set_level("WARNING", logger=compaction.log.name)
    assert compaction.compact_once(tmp_path / "r.db", threading.Event(), timeout_s=20) == 3
    [record] = [r for r in caplog.records if "failed (exit 3)" in r.getMessage()]
    assert record.getMessage().endswith("the real error")
    assert len(record.getMessage()) < compaction.ERROR_TAIL_BYTES + 200  # the tail, not the 256 KiB
