"""The hours kept decoded beside a flight recorder (``diag.sources.blocks``, written by ``diag.sources.compact``) never
change a Timeline: read through them or from every row's JSON, the same Timeline -- and a block that no longer
describes the recorder (a row written late into its hour, its hour trimmed, older code, a damaged file, a pickle
naming code) is not used. No process, no root."""

from __future__ import annotations

import logging
import pickle
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from collectors.recorder import FlightRecorder
from collectors.records import HostSnapshot, LoaderEvent, OomEvent, ServiceConfig
from diag.sources import blocks, load_recorder
from diag.sources.compact import compact
from tests.diag.loader_rows import T0, assert_same, records

# The block's "hour" shortened to 6 minutes (and "late" to one), so a recorder of a few thousand rows spans several.
HOUR, LATE = 360.0, 60.0
FIRST_HOUR = (T0 // HOUR + 1) * HOUR  # T0 is 80 s into its block: the first block held whole starts here
SECONDS = int(FIRST_HOUR - T0 + 2 * HOUR + 200)  # rows every second from T0: a partial block, 2 whole ones, a partial
LATER = T0 + 10 * 86_400.0  # "now", long after the recording: every block is over


@pytest.fixture(autouse=True)
def short_hours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "BLOCK_S", HOUR)
    monkeypatch.setattr(blocks, "LATE_S", LATE)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocks") / "rec.db"
    kept_whole = [  # records the Timeline keeps whole, inside a stored block (the unpickler must build them)
        ServiceConfig(ts=FIRST_HOUR + 30, service="demo", settings={"workers": 2, "max_concurrency": 8}),
        OomEvent(ts=FIRST_HOUR + 40, constraint="CONSTRAINT_MEMCG", pid=77, task="python"),
        LoaderEvent(ts=FIRST_HOUR + HOUR + 5, name="ckpt", start=FIRST_HOUR + HOUR + 4, duration_s=1.0, in_request_path=True),
    ]
    with FlightRecorder(path, retention_s=10**9) as rec:
        rec.write_rows(records(np.random.default_rng(5), SECONDS, odd_rows=True))
        rec.write(kept_whole)
    return path


@pytest.fixture
def recorder(written: Path, tmp_path: Path) -> Path:
    """A copy of the module's recorder for each test (the tests add rows, trim and write blocks beside it)."""
    path = tmp_path / "rec.db"
    with sqlite3.connect(written) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return path


def _both(path: Path, **window: float) -> None:
    """Read through the blocks and from JSON alone: the same Timeline."""
    assert_same(load_recorder(path, **window, use_blocks=True), load_recorder(path, **window, use_blocks=False))


def test_the_stored_hours_give_the_timeline_the_json_gives(recorder: Path) -> None:
    done = compact(recorder, now=LATER)
    stored = blocks.usable(recorder, None, None)
    assert stored[0].builder.kept["configs"][0].settings["max_concurrency"] == 8  # kept whole, and stored
    assert (done.written, done.kept, done.dropped) == (3, 0, 0)  # two whole hours after the first partial one, a partial
    assert [b.lo for b in blocks.BlockFile.open_for_reading(recorder).index()] == [FIRST_HOUR + k * HOUR for k in range(3)]
    assert len(blocks.usable(recorder, None, None)) == 3
    _both(recorder)
    _both(recorder, since_s=2 * HOUR + 17, until=T0 + SECONDS - 123.5)  # a window cutting two hours
    _both(recorder, since_s=HOUR, until=FIRST_HOUR + 2 * HOUR)  # one ending where a stored hour ends
    again = compact(recorder, now=LATER)
    assert (again.written, again.kept, again.dropped) == (0, 3, 0)


def test_a_row_written_late_into_a_stored_hour_sends_that_hour_back_to_its_json(recorder: Path) -> None:
    compact(recorder, now=LATER)
    late = HostSnapshot(ts=FIRST_HOUR + HOUR + 10.25, memory={"total": 1 << 30, "available": 1 << 29})
    with FlightRecorder(recorder, retention_s=10**9) as rec:
        rec.write([late])
    assert [c.lo for c in blocks.usable(recorder, None, None)] == [FIRST_HOUR, FIRST_HOUR + 2 * HOUR]
    with_late = load_recorder(recorder)
    assert FIRST_HOUR + HOUR + 10.25 in with_late.host["memory.available"].ts  # the late row is in
    _both(recorder)
    done = compact(recorder, now=LATER)
    assert (done.written, done.kept) == (1, 2)


def test_a_trimmed_hour_is_read_from_what_is_left_and_its_block_dropped(recorder: Path) -> None:
    compact(recorder, now=LATER)
    with sqlite3.connect(recorder) as db:  # what the agent's retention does to the oldest rows
        db.execute("DELETE FROM records WHERE ts < ?", (FIRST_HOUR + HOUR / 2,))
    assert [c.lo for c in blocks.usable(recorder, None, None)] == [FIRST_HOUR + HOUR, FIRST_HOUR + 2 * HOUR]
    _both(recorder)
    done = compact(recorder, now=LATER)
    assert (done.written, done.kept, done.dropped) == (0, 2, 1)


def test_an_hour_not_yet_over_is_left_to_the_json(recorder: Path) -> None:
    done = compact(recorder, now=T0 + SECONDS)  # at the last row: its hour is not over
    assert done.written == 2
    last_over = FIRST_HOUR + 3 * HOUR + LATE  # when the last hour is over, rows written late included
    assert compact(recorder, now=last_over - 1).written == 0
    assert compact(recorder, now=last_over).written == 1


def test_blocks_written_by_other_code_are_ignored_and_replaced(recorder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compact(recorder, now=LATER)
    monkeypatch.setattr(blocks, "version", lambda: "another")
    assert blocks.usable(recorder, None, None) == []
    _both(recorder)
    done = compact(recorder, now=LATER)
    assert (done.written, done.dropped) == (3, 3)


def test_a_damaged_blocks_file_is_read_around_and_replaced(recorder: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocks.blocks_path(recorder).write_bytes(b"not a database" * 100)
    with caplog.at_level(logging.WARNING):
        _both(recorder)
    assert "is not readable" in caplog.text
    assert compact(recorder, now=LATER).written == 3
    _both(recorder)


def test_a_block_that_names_code_is_refused(recorder: Path, caplog: pytest.LogCaptureFixture) -> None:
    compact(recorder, now=LATER)

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            import os

            return os.system, ("echo never",)

    with sqlite3.connect(blocks.blocks_path(recorder)) as db:
        db.execute("UPDATE blocks SET head = ?, sizes = '[]', data = x'' WHERE lo = ?", (pickle.dumps(Evil()), FIRST_HOUR))
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        blocks.loads(pickle.dumps(Evil()), [], b"")
    with pytest.raises(pickle.UnpicklingError, match=r"may not name numpy\.testing\..*assert_equal"):  # numpy's too
        blocks.loads(pickle.dumps(np.testing.assert_equal), [], b"")
    with caplog.at_level(logging.WARNING):
        assert blocks.usable(recorder, None, None) == []
    assert "may not name posix.system" in caplog.text or "may not name os.system" in caplog.text
    _both(recorder)


def test_reading_never_writes_beside_the_recorder(recorder: Path) -> None:
    load_recorder(recorder)
    assert not blocks.blocks_path(recorder).exists()
    recorder.chmod(0o640)
    compact(recorder, now=LATER)
    assert oct(blocks.blocks_path(recorder).stat().st_mode & 0o777) == "0o640"  # readable by whom the recorder is


def test_the_gaps_the_blocks_leave() -> None:
    cached = [blocks.Cached(3600.0, 7200.0, None), blocks.Cached(7200.0, 10800.0, None)]  # type: ignore[arg-type]
    assert list(blocks.gaps(cached, None, None)) == [(None, np.nextafter(3600.0, 0)), (10800.0, None)]
    assert list(blocks.gaps(cached, 3600.0, 10800.0)) == [(10800.0, 10800.0)]  # until is inclusive
    assert list(blocks.gaps([], 5.0, 9.0)) == [(5.0, 9.0)]


@pytest.mark.process
def test_the_hours_around_the_stored_ones_read_by_forked_readers(recorder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the blocks, the hours left to JSON are read by forked readers while the blocks are read (from
    ``GAP_READERS_MIN_ROWS`` rows): the same Timeline as one reader of JSON."""
    import diag.sources.recorder as loaders

    compact(recorder, now=LATER)
    monkeypatch.setattr(loaders, "GAP_READERS_MIN_ROWS", 0)
    started = []
    real = loaders._start_readers
    monkeypatch.setattr(loaders, "_start_readers", lambda *a: started.append(a[1]) or real(*a))
    reference = load_recorder(recorder, workers=1, use_blocks=False)
    assert_same(load_recorder(recorder, workers=2), reference)
    assert started and len(started[0]) == 2  # the partial hour before the stored ones and the open end after
    monkeypatch.setattr(loaders, "PARALLEL_MIN_ROWS", 10)  # large ranges: each split among the readers, as without blocks
    assert_same(load_recorder(recorder, workers=2), reference)
    assert len(started[1]) == 3  # the partial hour in two; the open end holds no row: one
