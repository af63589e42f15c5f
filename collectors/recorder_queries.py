"""Every SQL statement against the flight recorder's tables: the writer's, and the queries its readers need.

Why one module: the writer (``collectors.recorder``), the Timeline loaders (``diag.sources.recorder``), the
bundle's history collector and the scenario harness all read the same ``records`` table. Had each kept
its own SQL, a change of the schema or of an index would have to be found in four places -- and a reader
that orders rows differently from another builds a different Timeline. Here is the schema, every
statement, and ``RecorderReader``: a read-only connection with the reads by time, by kind in windows of
time, by row id and by size that the readers share.

Time bounds are inclusive everywhere (``since <= ts <= until``, either may be None), and rows of one
instant come in the order they were written (``ts, id``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from collectors.records import RequestTiming

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_ts ON records(ts);
CREATE INDEX IF NOT EXISTS records_kind_ts ON records(kind, ts);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
TABLES = "SELECT name FROM sqlite_master WHERE type = 'table'"
SET_FORMAT = "INSERT OR IGNORE INTO meta(key, value) VALUES ('format', ?)"
DELETE_OLDER_THAN = "DELETE FROM records WHERE ts < ?"
DELETE_OLDEST = "DELETE FROM records WHERE id IN (SELECT id FROM records ORDER BY ts LIMIT ?)"
RECORD_INSERT_HEAD = "INSERT INTO records(ts, kind, schema, body) VALUES "
RECORD_VALUES = "(?,?,?,?)"

# ---------------------------------------------------------------- request rows rendered by SQLite
# A tracked server writes one RequestTiming per request: the hottest write path there is. Rendering
# its JSON in Python (even with one f-string) holds the GIL the event loop needs; here the writer
# thread binds plain values and SQLite renders the very same JSON object as ``Record.to_json``
# (same keys in the same order; timestamps with microsecond precision) inside ``sqlite3_step``, which
# runs with the GIL released. Row layout (``REQUEST_ROW_FIELDS``; timestamps in integer microseconds,
# strings already JSON-encoded, trace_id as bare hex):
REQUEST_ROW_FIELDS = (
    "finish_us", "arrival_us", "start_us", "outcome_json", "route_json", "model_json",
    "prompt_tokens", "output_tokens", "ttft_s", "pid", "trace_id_hex",
)  # fmt: skip
RequestRow = tuple  # one tuple of len(REQUEST_ROW_FIELDS) values, in that order
# Absent values, as ``buffer.request_row`` binds them: ``start_us`` -1, ``trace_id_hex`` '', the
# numbers the text 'null' (what the JSON holds). Why not None: Python's sqlite3 sends every bound
# None through its adapter protocol (two failed attribute lookups, each building an AttributeError
# message) -- ~3k CPU instructions per None, ~13k per typical row, more than the B-tree inserts.
# SQL NULL is still accepted in every column (rows built by hand, older callers).
REQUEST_NO_START_US = -1
REQUEST_NO_TRACE_ID = ""
REQUEST_NULL = "null"


def _us_fmt(col: str) -> tuple[str, list[str]]:
    """printf pieces for integer microseconds -> '1796045021.000005' (exact; REAL text would keep 15 digits)."""
    return "%d.%06d", [f"{col} / 1000000", f"{col} % 1000000"]


def _request_body_sql() -> str:
    """One ``printf`` builds the whole JSON object: one string allocation per row, where a chain of
    ``||`` concatenations allocated and copied a growing string ~30 times (~19k instructions)."""
    c = {name: f"column{i + 1}" for i, name in enumerate(REQUEST_ROW_FIELDS)}
    fin_fmt, fin_args = _us_fmt(c["finish_us"])
    arr_fmt, arr_args = _us_fmt(c["arrival_us"])
    start_fmt, start_args = _us_fmt(c["start_us"])
    start = (
        f"CASE WHEN {c['start_us']} IS NULL OR {c['start_us']} < 0 THEN 'null' "
        f"ELSE printf('{start_fmt}', {', '.join(start_args)}) END"
    )
    trace = (
        f"CASE WHEN {c['trace_id_hex']} IS NULL OR {c['trace_id_hex']} = '' THEN 'null' "
        f"ELSE '\"' || {c['trace_id_hex']} || '\"' END"
    )

    def nullable(col: str) -> str:
        return f"ifnull({col}, 'null')"

    fmt = (
        f'{{"kind":"{RequestTiming.KIND}","schema":{RequestTiming.SCHEMA},"ts":{fin_fmt},"arrival":{arr_fmt},'
        f'"start":%s,"finish":{fin_fmt},"outcome":%s,"route":%s,"model":%s,"prompt_tokens":%s,'
        f'"output_tokens":%s,"ttft_s":%s,"pid":%s,"trace_id":%s}}'
    )
    args = [
        *fin_args, *arr_args, start, *fin_args, c["outcome_json"], c["route_json"], c["model_json"],
        nullable(c["prompt_tokens"]), nullable(c["output_tokens"]), nullable(c["ttft_s"]), nullable(c["pid"]), trace,
    ]  # fmt: skip
    return f"printf('{fmt}', {', '.join(args)})"


REQUEST_INSERT_HEAD = (
    f"INSERT INTO records(ts, kind, schema, body) SELECT column1 / 1000000.0, '{RequestTiming.KIND}', "
    f"{RequestTiming.SCHEMA}, {_request_body_sql()} FROM (VALUES "
)
REQUEST_VALUES = "(" + ",".join("?" * len(REQUEST_ROW_FIELDS)) + ")"
REQUEST_INSERT_TAIL = ")"


# ---------------------------------------------------------------- reading


def connect_readonly(path: str | Path, timeout_s: float = 10.0) -> sqlite3.Connection:
    """A read-only connection (it never creates the file, never takes a write lock)."""
    return sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=timeout_s, check_same_thread=False)


def _bounds(since: float | None, until: float | None) -> tuple[list[str], list[float]]:
    where, params = [], []
    if since is not None:
        where.append("ts >= ?")
        params.append(since)
    if until is not None:
        where.append("ts <= ?")
        params.append(until)
    return where, params


def _where(clauses: Sequence[str]) -> str:
    return (" WHERE " + " AND ".join(clauses)) if clauses else ""


class RecorderReader:
    """The reads every reader of a flight recorder needs, over one connection (read-only when opened with ``open``).

    Not shared across threads. ``begin()`` pins one snapshot for every query after it (the agent may be
    writing meanwhile), as a single SELECT would see.
    """

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    @classmethod
    def open(cls, path: str | Path, timeout_s: float = 10.0) -> RecorderReader:
        return cls(connect_readonly(path, timeout_s))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> RecorderReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin(self) -> None:
        self.db.execute("BEGIN")

    def end(self) -> None:
        """End the snapshot ``begin`` opened (a long-lived reader would keep the writer's WAL from being reset)."""
        if self.db.in_transaction:
            self.db.execute("COMMIT")

    def _one(self, sql: str, params: Sequence[Any]) -> Any:
        row = self.db.execute(sql, params).fetchone()
        return None if row is None else row[0]

    # ---- by time, every kind

    def rows(
        self, kinds: Sequence[str] | None = None, since: float | None = None, until: float | None = None
    ) -> Iterator[tuple[float, str, str]]:
        """``(ts, kind, body)`` in time order (rows of one instant in the order written)."""
        where, params = _bounds(since, until)
        if kinds:
            where.insert(0, f"kind IN ({','.join('?' * len(kinds))})")
            params[:0] = list(kinds)  # type: ignore[arg-type]
        yield from self.db.execute(f"SELECT ts, kind, body FROM records{_where(where)} ORDER BY ts, id", params)

    def kinds(self) -> list[str]:
        """The kinds in the file, by seeks on the (kind, ts) index rather than a scan of it."""
        kinds: list[str] = []
        kind = self._one("SELECT min(kind) FROM records", ())
        while kind is not None:
            kinds.append(kind)
            kind = self._one("SELECT min(kind) FROM records WHERE kind > ?", (kind,))
        return kinds

    def count(self, since: float | None = None, until: float | None = None, kind: str | None = None) -> int:
        where, params = _bounds(since, until)
        if kind is not None:
            where.insert(0, "kind = ?")
            params.insert(0, kind)  # type: ignore[arg-type]
        return int(self._one(f"SELECT COUNT(*) FROM records{_where(where)}", params))

    def ts_at(self, offset: int, since: float | None = None, until: float | None = None) -> float | None:
        """The time of the row ``offset`` rows into [since, until] (None past the end)."""
        where, params = _bounds(since, until)
        return self._one(f"SELECT ts FROM records{_where(where)} ORDER BY ts LIMIT 1 OFFSET ?", (*params, offset))

    def latest_before(self, kind: str, ts: float) -> str | None:
        """The body of the last row of ``kind`` before ``ts``."""
        return self._one("SELECT body FROM records WHERE kind = ? AND ts < ? ORDER BY ts DESC LIMIT 1", (kind, ts))

    # ---- one kind, window after window of time

    def first_ts(self, kind: str, since: float | None = None, until: float | None = None) -> float | None:
        where, params = _bounds(since, until)
        return self._one(f"SELECT min(ts) FROM records WHERE {' AND '.join(['kind = ?', *where])}", (kind, *params))

    def next_ts(self, kind: str, after: float, until: float | None = None) -> float | None:
        """The first time of ``kind`` strictly after ``after``."""
        where, params = _bounds(None, until)
        return self._one(f"SELECT min(ts) FROM records WHERE {' AND '.join(['kind = ? AND ts > ?', *where])}",
                         (kind, after, *params))  # fmt: skip

    def ts_after_rows(self, kind: str, lo: float, rows: int, until: float | None = None) -> float | None:
        """The time of the row ``rows`` rows of ``kind`` from ``lo`` on (None: fewer rows are left)."""
        where, params = _bounds(lo, until)
        sql = f"SELECT ts FROM records WHERE {' AND '.join(['kind = ?', *where])} ORDER BY ts LIMIT 1 OFFSET ?"
        return self._one(sql, (kind, *params, rows))

    def sample(self, kind: str, lo: float, n: int) -> list[str]:
        """The bodies of the first ``n`` rows of ``kind`` from ``lo`` on (to size the windows by)."""
        sql = "SELECT body FROM records WHERE kind = ? AND ts >= ? ORDER BY ts LIMIT ?"
        return [body for (body,) in self.db.execute(sql, (kind, lo, n))]

    @staticmethod
    def _window(kind: str, lo: float, hi: float | None, until: float | None) -> tuple[str, tuple[Any, ...]]:
        """Rows of ``kind`` with ``lo <= ts < hi`` -- or, for the last window (``hi`` None), ``lo <= ts <= until``."""
        if hi is not None:
            return "kind = ? AND ts >= ? AND ts < ?", (kind, lo, hi)
        where, params = _bounds(lo, until)
        return " AND ".join(["kind = ?", *where]), (kind, *params)

    def joined(self, kind: str, lo: float, hi: float | None, until: float | None = None) -> tuple[str | None, int]:
        """A window's bodies as one JSON array, joined by SQLite, and how many: no Python object per row.

        SQLite 3.40 does not promise ``group_concat``'s order (ORDER BY inside aggregates is 3.44+), though it keeps
        the subquery's: a caller that depends on it checks the times it decodes. (Text, bracketed here: having
        SQLite bracket it and hand it over as a BLOB measured ~35 % slower to load, 3 alternating runs each.)
        """
        where, params = self._window(kind, lo, hi, until)
        sql = f"SELECT group_concat(body, ','), count(*) FROM (SELECT body FROM records WHERE {where} ORDER BY ts, id)"
        text, count = self.db.execute(sql, params).fetchone()
        return (None if text is None else "[" + text + "]"), int(count)

    def bodies(self, kind: str, lo: float, hi: float | None, until: float | None = None) -> list[str]:
        """A window's bodies, one string each, in time order."""
        where, params = self._window(kind, lo, hi, until)
        return [body for (body,) in self.db.execute(f"SELECT body FROM records WHERE {where} ORDER BY ts, id", params)]

    # ---- by row id (ids only grow: what was added since a run is what lies past its last id)

    def max_id(self) -> int:
        return int(self._one("SELECT max(id) FROM records", ()) or 0)

    def ts_range(self) -> tuple[float, float] | None:
        """(first, last) row time, None when empty: two seeks on the time index."""
        row = self.db.execute("SELECT min(ts), max(ts) FROM records").fetchone()
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))

    def ids_between(self, lo: float, hi: float) -> tuple[int, int, int]:
        """(count, sum, max) of the row ids with ``lo <= ts < hi``: what tells that a time range still holds exactly the
        rows it held when last read -- a row added late, or one trimmed, changes the count or the sum. The time index
        holds every row's id, so this reads the index alone."""
        row = self.db.execute("SELECT count(*), total(id), max(id) FROM records WHERE ts >= ? AND ts < ?", (lo, hi)).fetchone()
        return int(row[0]), int(row[1]), int(row[2] or 0)

    def count_from(self, since: float, up_to_id: int) -> int:
        """Rows at or after ``since`` among those with an id up to ``up_to_id``."""
        return int(self._one("SELECT count(*) FROM records WHERE ts >= ? AND id <= ?", (since, up_to_id)))

    def rows_by_id(self, after_id: int, up_to_id: int, since: float) -> list[tuple[int, float, str, str]]:
        """``(id, ts, kind, body)`` with ``after_id < id <= up_to_id`` and ``ts >= since``, in id order."""
        sql = "SELECT id, ts, kind, body FROM records WHERE id > ? AND id <= ? AND ts >= ? ORDER BY id"
        return self.db.execute(sql, (after_id, up_to_id, since)).fetchall()

    # ---- by size

    def size_from(self, since: float) -> tuple[int, int]:
        """Bytes of JSON and rows at or after ``since``."""
        total, count = self.db.execute(
            "SELECT COALESCE(SUM(LENGTH(body)), 0), COUNT(*) FROM records WHERE ts >= ?", (since,)
        ).fetchone()
        return int(total), int(count)

    def lengths_newest_first(self, since: float) -> Iterator[tuple[float, int]]:
        """``(ts, bytes of JSON)`` of every row at or after ``since``, newest first."""
        yield from self.db.execute("SELECT ts, LENGTH(body) FROM records WHERE ts >= ? ORDER BY ts DESC", (since,))

    # ---- the whole file

    def backup(self, dst: str | Path) -> None:
        """A consistent copy of the file at ``dst`` (SQLite's backup API: the WAL's contents are included)."""
        target = sqlite3.connect(str(dst))
        try:
            self.db.backup(target)
        finally:
            target.close()
