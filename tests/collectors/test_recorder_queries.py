"""The recorder's SQL in one place (``collectors.recorder_queries``): what its readers rely on, and that no one else spells it."""

from __future__ import annotations

import re
from pathlib import Path

from collectors.recorder import FlightRecorder
from collectors.recorder_queries import RecorderReader
from tests.paths import REPO

T0 = 1_790_000_000.0


def _recorder(path: Path) -> Path:
    rows = [(T0 + i, "host", 1, f'{{"kind":"host","ts":{T0 + i}}}') for i in range(10)]
    rows += [(T0 + 5, "request", 1, f'{{"kind":"request","ts":{T0 + 5},"n":{k}}}') for k in range(3)]  # one instant
    rows += [(T0 - 100, "watch_scope", 1, '{"kind":"watch_scope","ts":0,"pids":[1]}')]
    with FlightRecorder(path) as rec:
        rec.write_rows(rows)
    return path


def test_reads_by_time_are_inclusive_and_in_written_order(tmp_path: Path) -> None:
    with RecorderReader.open(_recorder(tmp_path / "r.db")) as reader:
        assert reader.kinds() == ["host", "request", "watch_scope"]
        assert reader.count() == 14 and reader.count(T0 + 2, T0 + 5) == 7 and reader.count(kind="request") == 3
        got = list(reader.rows(["request"], since=T0 + 5, until=T0 + 5))
        assert [body[-2] for _, _, body in got] == ["0", "1", "2"]  # one instant: the order written
        assert reader.ts_at(0) == T0 - 100 and reader.ts_at(5, since=T0) == T0 + 5 and reader.ts_at(99) is None
        assert reader.latest_before("watch_scope", T0) == '{"kind":"watch_scope","ts":0,"pids":[1]}'
        assert reader.latest_before("watch_scope", T0 - 100) is None


def test_windows_of_one_kind(tmp_path: Path) -> None:
    with RecorderReader.open(_recorder(tmp_path / "r.db")) as reader:
        assert reader.first_ts("host", since=T0 + 2.5) == T0 + 3 and reader.first_ts("host", until=T0 - 1) is None
        assert reader.next_ts("host", T0 + 3) == T0 + 4 and reader.next_ts("host", T0 + 9) is None
        assert reader.ts_after_rows("host", T0, 4) == T0 + 4 and reader.ts_after_rows("host", T0, 4, until=T0 + 3) is None
        array, n = reader.joined("host", T0 + 1, T0 + 3)  # [lo, hi)
        assert n == 2 and array == f'[{{"kind":"host","ts":{T0 + 1}}},{{"kind":"host","ts":{T0 + 2}}}]'
        assert len(reader.bodies("host", T0 + 8, None)) == 2 and len(reader.bodies("host", T0 + 8, None, until=T0 + 8)) == 1
        assert reader.joined("host", T0 + 20, None) == (None, 0)
        assert reader.sample("host", T0 + 8, 64) == [f'{{"kind":"host","ts":{T0 + 8}}}', f'{{"kind":"host","ts":{T0 + 9}}}']


def test_reads_by_id_and_by_size(tmp_path: Path) -> None:
    path = _recorder(tmp_path / "r.db")
    with RecorderReader.open(path) as reader:
        top = reader.max_id()
        assert top == 14 and [r[0] for r in reader.rows_by_id(10, top, T0)] == [11, 12, 13]
        assert reader.count_from(T0 + 5, 10) == 5  # hosts 5..9 have ids 6..10
        size, count = reader.size_from(T0 + 9)
        assert count == 1 and size == len(f'{{"kind":"host","ts":{T0 + 9}}}')
        assert [ts for ts, _ in reader.lengths_newest_first(T0 + 8)] == [T0 + 9, T0 + 8]
        reader.backup(tmp_path / "copy.db")
    with RecorderReader.open(tmp_path / "copy.db") as copy:
        assert copy.count() == 14


def test_no_module_but_the_owner_spells_sql_against_the_records_table() -> None:
    statement = re.compile(r"\b(FROM|INTO|UPDATE|TABLE(?: IF NOT EXISTS)?)\s+records\b", re.IGNORECASE)
    owner = REPO / "collectors" / "recorder_queries.py"
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for package in ("collectors", "diag", "alerts", "dashboards")
        for path in sorted((REPO / package).rglob("*.py"))
        if path != owner
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if statement.search(line)
    ]
    assert found == []
    assert statement.search(owner.read_text())  # the pattern does match real SQL
