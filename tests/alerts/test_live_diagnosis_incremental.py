"""The live diagnosis reads its window incrementally: the Timeline (and so the verdict) must be the full load's.

A real flight recorder (``collectors.recorder.FlightRecorder``) is filled with a scenario recording a few
seconds at a time -- the tracker's rows written late, as its batching writer does, so row ids and
times disagree -- and after every append ``RecorderWindow.load`` is compared with a full
``load_recorder`` of the same window: field by field, and through the rules engine. Then the file is
trimmed into the window, and moved aside and replaced, and the two must still agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from collectors.recorder import FlightRecorder
from collectors.records import record_from_dict
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.sources import load_recorder
from diag.sources import recorder as recorder_source
from diag.sources.recorder import RecorderWindow
from diag.timeline import Timeline
from diag.timeline.model import Series, Table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
AGENT_KINDS = {"host", "cgroup", "process", "gpu", "oom", "watch_scope"}
TRACKER_LAG_S = 3.0  # the tracker's rows reach the recorder this much after their time
WINDOW_S = 20.0
STEP_S = 4.0


def _records(name: str) -> list[dict[str, Any]]:
    return sorted(read_jsonl_gz(FIXTURES / f"{name}.jsonl.gz"), key=lambda r: r["ts"])


def _appends(records: list[dict[str, Any]]) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    """(now, the records that reach the recorder by then): the agent's at once, the tracker's ``TRACKER_LAG_S`` late."""
    start, end = records[0]["ts"], records[-1]["ts"] + TRACKER_LAG_S
    written: set[int] = set()
    now = start + STEP_S
    while now < end + STEP_S:
        due = [
            i
            for i, r in enumerate(records)
            if i not in written and r["ts"] <= (now if r["kind"] in AGENT_KINDS else now - TRACKER_LAG_S)
        ]
        written.update(due)
        yield now, [records[i] for i in due]
        now += STEP_S


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    rec = FlightRecorder(path, retention_s=1e12)
    try:
        rec.write(record_from_dict(r) for r in records)
    finally:
        rec.close()


def _same_series(a: dict[str, Series], b: dict[str, Series], where: str) -> None:
    assert set(a) == set(b), where
    for name in a:
        np.testing.assert_array_equal(a[name].ts, b[name].ts, err_msg=f"{where} {name} ts")
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=f"{where} {name} values")


def _same_table(a: Table, b: Table, where: str) -> None:
    assert list(a.columns) == list(b.columns), where
    for name in a.columns:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{where} {name}")


def assert_same_timeline(got: Timeline, want: Timeline) -> None:
    assert (got.start, got.end, got.source) == (want.start, want.end, want.source)
    assert got.counts == want.counts and got.skipped == want.skipped
    _same_series(got.host, want.host, "host")
    assert list(got.cgroups) == list(want.cgroups)
    for path in want.cgroups:
        _same_series(got.cgroups[path], want.cgroups[path], f"cgroup {path}")
    assert list(got.processes) == list(want.processes)  # first-seen order: rules pick among equals by it
    for key, track in want.processes.items():
        mine = got.processes[key]
        facts = ("pid", "start_time_s", "comm", "cmdline", "memory_cgroup", "model_files", "ppid")
        assert [getattr(mine, f) for f in facts] == [getattr(track, f) for f in facts], key
        _same_series(mine.series, track.series, f"process {key}")
    assert list(got.gpus) == list(want.gpus) and got.gpu_unavailable_reason == want.gpu_unavailable_reason
    for index in want.gpus:
        _same_series(got.gpus[index], want.gpus[index], f"gpu {index}")
    for table in ("gpu_processes", "requests", "batches", "routing", "loader", "torch"):
        _same_table(getattr(got, table), getattr(want, table), table)
    assert (got.ooms, got.cuda_ooms, got.configs, got.watch_scopes) == (
        want.ooms,
        want.cuda_ooms,
        want.configs,
        want.watch_scopes,
    )


class _Clock:
    """``time`` for ``diag.sources.recorder``: both loaders take "now" from it, as in the agent."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def _check(window: RecorderWindow, path: Path, now: float) -> Timeline:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recorder_source, "time", _Clock(now))
        got = window.load()
        want = load_recorder(path, since_s=WINDOW_S, workers=1)
    assert_same_timeline(got, want)
    assert analyze(got).to_dict() == analyze(want).to_dict()
    return got


@pytest.mark.parametrize("scenario", ["leak", "host-oom", "request-count-batching"])
def test_incremental_window_equals_a_full_load_across_appends(tmp_path: Path, scenario: str) -> None:
    path = tmp_path / "recorder.db"
    window = RecorderWindow(path, WINDOW_S, segment_s=STEP_S)
    steps = list(_appends(_records(scenario)))
    first = int(WINDOW_S / STEP_S) + 2  # the recorder already holds more than a window at the first run
    for _, batch in steps[:first]:
        _write(path, batch)
    _check(window, path, steps[first - 1][0])
    read_first, full = window.rows_read, 0
    for now, batch in steps[first:]:
        _write(path, batch)
        full += sum(_check(window, path, now).counts.values())  # what a full read decodes
    assert window.full_reads == 1  # the first run only: after it, only new rows and the window's cut segment
    # each run decodes the rows of the last STEP_S and the segment the window's start cuts through (about
    # as many): at most ~2/5 of what a full read of the WINDOW_S window decodes
    assert window.rows_read - read_first <= 0.5 * full


def test_a_trim_into_the_window_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "recorder.db"
    window = RecorderWindow(path, WINDOW_S)
    steps = list(_appends(_records("leak")))
    for now, batch in steps[:8]:
        _write(path, batch)
        _check(window, path, now)
    now = steps[7][0]
    rec = FlightRecorder(path, retention_s=WINDOW_S / 2)  # the retention trim deletes the window's older half
    try:
        assert rec.trim(now=now).deleted_by_age > 0
    finally:
        rec.close()
    reads = window.full_reads
    _check(window, path, now)
    assert window.full_reads == reads + 1
    for now, batch in steps[8:12]:  # and incremental again after it
        _write(path, batch)
        _check(window, path, now)
    assert window.full_reads == reads + 1


def test_a_recorder_moved_aside_and_replaced_is_read_afresh(tmp_path: Path) -> None:
    path = tmp_path / "recorder.db"
    window = RecorderWindow(path, WINDOW_S)
    steps = list(_appends(_records("queue")))
    for now, batch in steps[:6]:
        _write(path, batch)
        _check(window, path, now)
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{path}{suffix}.old")
    now, batch = steps[6]
    _write(path, batch)  # a fresh file: its row ids start again at 1, fewer rows than before
    reads = window.full_reads
    _check(window, path, now)
    assert window.full_reads == reads + 1


def test_the_clock_going_back_reads_afresh(tmp_path: Path) -> None:
    path = tmp_path / "recorder.db"
    window = RecorderWindow(path, WINDOW_S)
    steps = list(_appends(_records("leak")))
    for now, batch in steps[:8]:
        _write(path, batch)
        _check(window, path, now)
    reads = window.full_reads
    _check(window, path, steps[4][0])  # an earlier window holds rows the segments left out
    assert window.full_reads == reads + 1
