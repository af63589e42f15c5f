"""The incident store: one SQLite file (WAL) by default, or a PostgreSQL database -- the receiver's only durable state.

Two backends, one interface: ``--db PATH`` is SQLite, the embedded default (one receiver beside the agent);
``--db postgresql://...`` is PostgreSQL (``diag.triage.pg``), for receivers active-active behind Alertmanager
peers. The triage logic and the statements below are the same for both: ``diag.triage.pg`` gives psycopg the
surface of ``sqlite3`` (placeholders, ``INSERT OR IGNORE``, rows by name), takes one advisory lock per write
transaction so writers take turns as they do on SQLite, and keeps the schema version in ``schema_migrations``
where SQLite keeps it in ``PRAGMA user_version``. What follows says "SQLite"; it holds for PostgreSQL except where
a sentence names the file.

Why SQLite: embedded (the receiver is one process beside the agent), transactional, and its
``UNIQUE(key, generation)`` constraint is what makes duplicates impossible rather than unlikely --
several receiver threads, several Alertmanager peers and retries after a crash all race to insert
the same incident, and the constraint lets exactly one win. ``synchronous=FULL`` in WAL mode: a
commit is on disk (fsync'd) before the webhook answers 2xx, so an acknowledged alert survives
``kill -9`` and power loss alike; group commit (``diag.triage.ingest``) keeps that affordable.

Everything else -- diagnoses to run, tickets to file -- is a row here too (a transactional outbox),
so a crash between "incident changed" and "ticket updated" loses nothing.

Schema versions (``PRAGMA user_version``): ``SCHEMA`` is the newest schema, for new stores; an existing store
is brought up to it by ``MIGRATIONS``, each step idempotent and run once, in order, in one transaction when
the store is opened. A later change appends a step (and bumps ``SCHEMA_VERSION``) -- it never edits one.

A file that is not a triage store is ``StoreCorrupt``: not SQLite, or damaged (``foreign`` False: the receiver
moves it aside and starts afresh), or a healthy SQLite database of something else (``foreign`` True: never
touched -- it is most likely another program's file given as ``--db`` by mistake).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    generation INTEGER NOT NULL DEFAULT 1,
    key_labels TEXT NOT NULL,
    title TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('open', 'resolving', 'resolved', 'closed')),
    resolution TEXT,
    severity TEXT NOT NULL DEFAULT '',
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    generator_url TEXT NOT NULL DEFAULT '',
    group_key TEXT NOT NULL DEFAULT '',
    external_url TEXT NOT NULL DEFAULT '',
    starts_at REAL NOT NULL,
    opened_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    resolve_due REAL,
    resolved_at REAL,
    closed_at REAL,
    reopen_count INTEGER NOT NULL DEFAULT 0,
    flapping INTEGER NOT NULL DEFAULT 0,
    truncated_alerts INTEGER NOT NULL DEFAULT 0,
    diag_state TEXT NOT NULL DEFAULT 'pending' CHECK (diag_state IN ('pending', 'running', 'done', 'failed', 'off')),
    diag_requested REAL,
    diag_class TEXT,
    diag_doc TEXT,
    diag_at REAL,
    diag_error TEXT,
    diag_attempts INTEGER NOT NULL DEFAULT 0,
    bundle_path TEXT,
    diag_claimed_until REAL,
    UNIQUE (key, generation)
);
CREATE INDEX IF NOT EXISTS incidents_diag ON incidents (diag_state);
CREATE INDEX IF NOT EXISTS incidents_due ON incidents (status, resolve_due);
CREATE TABLE IF NOT EXISTS alerts (
    incident_id INTEGER NOT NULL REFERENCES incidents (id),
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,
    starts_at REAL NOT NULL,
    ends_at REAL,
    labels TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    PRIMARY KEY (incident_id, fingerprint)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    incident_id INTEGER NOT NULL REFERENCES incidents (id),
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_incident ON events (incident_id, ts);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    incident_id INTEGER NOT NULL REFERENCES incidents (id),
    sink TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('create', 'comment', 'close', 'reopen', 'diagnosis')),
    text TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    done_at REAL,
    last_error TEXT,
    failed_at REAL,
    sent_at REAL,
    claimed_until REAL
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (done_at, next_at);
CREATE TABLE IF NOT EXISTS tickets (
    incident_id INTEGER NOT NULL REFERENCES incidents (id),
    sink TEXT NOT NULL,
    external_id TEXT NOT NULL,
    url TEXT NOT NULL DEFAULT '',
    last_class TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (incident_id, sink)
);
CREATE TABLE IF NOT EXISTS merges (
    absorbed INTEGER PRIMARY KEY REFERENCES incidents (id),
    survivor INTEGER NOT NULL REFERENCES incidents (id),
    ts REAL NOT NULL,
    class TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS stats (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""
SQLITE_TRIGGERS = """
CREATE TRIGGER IF NOT EXISTS incidents_diagnosis_off_insert AFTER INSERT ON incidents
WHEN NEW.diag_state = 'pending' AND (SELECT value FROM settings WHERE name = 'diagnosis') = 'off'
BEGIN
    UPDATE incidents SET diag_state = 'off' WHERE id = NEW.id;
END;
CREATE TRIGGER IF NOT EXISTS incidents_diagnosis_off_update AFTER UPDATE OF diag_state ON incidents
WHEN NEW.diag_state = 'pending' AND (SELECT value FROM settings WHERE name = 'diagnosis') = 'off'
BEGIN
    UPDATE incidents SET diag_state = 'off' WHERE id = NEW.id;
END;
"""
SCHEMA_VERSION = 4
"""Version 4: claims (``outbox.claimed_until``, ``incidents.diag_claimed_until``), so several receivers on one
PostgreSQL store never send the same ticket action or run the same diagnosis twice.

``diag_state = 'off'``: the receiver runs without diagnosis (``--no-diagnosis``). The triggers turn the
'pending' that opening or reopening an incident asks for into 'off' while the ``diagnosis`` setting says so, in
the same statement, so no reader ever sees an incident waiting for a diagnosis that will not come."""

STATUSES = ("open", "resolving", "resolved", "closed")


class StoreCorrupt(sqlite3.DatabaseError):
    """The file at the store's path is not a triage store. ``foreign``: a healthy SQLite database of something
    else (leave it alone); otherwise damaged or not SQLite at all (it may be moved aside)."""

    def __init__(self, path: str | Path, detail: str, *, foreign: bool = False) -> None:
        super().__init__(f"{path} is not a readable triage store ({detail})")
        self.path = Path(path)
        self.detail = detail
        self.foreign = foreign


_CORRUPTION_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB


def _is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _CORRUPTION_CODES
    return "not a database" in str(exc) or "malformed" in str(exc)


def _check_header(path: Path) -> None:
    """Refuse a file that is not a SQLite database before a writable connection opens it (opening and closing such a
    file would delete the -wal and -shm beside it, which a look at what went wrong may need).

    The look goes through SQLite itself, read-only and ``immutable`` (no locks taken, no WAL opened), never through
    Python's ``open()``: POSIX record locks belong to the process and the file, so closing *any* descriptor of the
    store drops every lock this process's SQLite connections hold on it -- another process could then checkpoint
    and delete the WAL under a running receiver. SQLite's own descriptors are shared per file and closed safely.
    """
    if not path.exists():
        return
    if path.is_dir():
        raise StoreCorrupt(path, "a folder, not a file")
    if path.stat().st_size == 0:
        return  # an empty file is a new database
    probe = None
    try:
        probe = sqlite3.connect(f"file:{path.resolve()}?mode=ro&immutable=1", uri=True)
        probe.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc):
            raise StoreCorrupt(path, "not a SQLite database: the file does not start with the SQLite header") from None
        raise StoreCorrupt(path, f"unreadable as SQLite: {exc}") from None
    finally:
        if probe is not None:
            probe.close()


def _statements(script: str) -> Iterator[str]:
    """The statements of a script (a trigger's body holds semicolons of its own)."""
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _v2_outbox_failures_and_diagnosis_off(db: sqlite3.Connection) -> None:
    """Outbox rows can fail for good (``failed_at``) and remember a create sent without a known outcome
    (``sent_at``); ``diag_state`` may be 'off'. SQLite cannot alter a CHECK constraint, so the incidents table is
    rebuilt from its own stored definition with the one constraint widened (columns and rows as they are)."""
    have = _columns(db, "outbox")
    for name in ("failed_at", "sent_at"):
        if name not in have:
            db.execute(f"ALTER TABLE outbox ADD COLUMN {name} REAL")
    (sql,) = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'incidents'").fetchone()
    if "'off'" in sql:
        return
    old = "'done', 'failed')"
    if sql.count(old) != 1:
        raise StoreCorrupt(db_path(db), "incidents table with an unknown diag_state constraint", foreign=True)
    db.execute("DROP TABLE IF EXISTS incidents_v2")
    db.execute(sql.replace(old, "'done', 'failed', 'off')").replace("CREATE TABLE incidents", "CREATE TABLE incidents_v2", 1))
    db.execute("INSERT INTO incidents_v2 SELECT * FROM incidents")
    db.execute("DROP TABLE incidents")  # its indexes go with it; SCHEMA recreates them after the migrations
    db.execute("ALTER TABLE incidents_v2 RENAME TO incidents")


def _v3_merges(db: sqlite3.Connection) -> None:
    """Incidents joined as one problem (``diag.triage.correlate``): a new table only, which SCHEMA creates."""


def _v4_claims(db: sqlite3.Connection) -> None:
    """Claims of work that outlasts a transaction (see ``claim_outbox``, ``claim_diagnosis``)."""
    for table, name in (("outbox", "claimed_until"), ("incidents", "diag_claimed_until")):
        if name not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} REAL")


MIGRATIONS: tuple[tuple[int, Callable[[sqlite3.Connection], None]], ...] = (
    (2, _v2_outbox_failures_and_diagnosis_off),
    (3, _v3_merges),
    (4, _v4_claims),
)
"""(version, step): a store at version v gets every step above v, in order. A store without user_version but with
the incidents table is version 1 (the schema before versions were counted)."""


def db_path(db: sqlite3.Connection) -> str:
    row = db.execute("PRAGMA database_list").fetchone()
    return str(row[2]) if row is not None else "(memory)"


def _ensure_schema(db: sqlite3.Connection, path: Path) -> None:
    """Create the schema in a new store, migrate an older one, refuse one that is not ours. Idempotent and safe
    when several connections of one receiver open the store at once (the write lock is taken first)."""
    if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    db.execute("PRAGMA foreign_keys = OFF")  # a table rebuild drops and renames a referenced table
    db.execute("BEGIN IMMEDIATE")
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version < SCHEMA_VERSION:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and "incidents" not in tables:
                listed = ", ".join(sorted(tables)[:5])
                raise StoreCorrupt(path, f"a SQLite database of something else: tables {listed}", foreign=True)
            if "incidents" in tables:
                for step_version, step in MIGRATIONS:
                    if step_version > max(version, 1):
                        step(db)
            for statement in _statements(SCHEMA + SQLITE_TRIGGERS):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            problems = db.execute("PRAGMA foreign_key_check").fetchall()
            if problems:
                raise StoreCorrupt(path, f"{len(problems)} rows refer to rows that do not exist")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def store_target(value: str | Path) -> str | Path:
    """``--db``'s value: a ``postgresql://`` URL as it is, anything else a SQLite file's path."""
    from diag.triage.pg import is_url

    return value if is_url(value) else Path(value)


def is_shared(db: Any) -> bool:
    """Whether other receivers may write the same store (PostgreSQL): claims then matter, and a receiver starting
    must not take back work another one is doing."""
    return getattr(db, "dialect", "sqlite") == "postgresql"


def ensure_schema_pg(db: Any) -> None:
    """The same schema on PostgreSQL, versioned in a ``schema_migrations`` table (PostgreSQL has no user_version).

    A new store gets the newest schema; an older one the steps of ``MIGRATIONS`` above its version (a PostgreSQL
    store starts at version 4, so the SQLite-only table rebuilds before it never run here; later steps are written
    for both dialects). Under the writers' lock: receivers starting together create it once."""
    from diag.triage.pg import TRIGGERS, redact, schema_ddl

    with transaction(db):
        tables = {r[0] for r in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
        if tables and "incidents" not in tables:
            listed = ", ".join(sorted(tables)[:5])
            raise StoreCorrupt(redact(db.url), f"a PostgreSQL database of something else: tables {listed}", foreign=True)
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        version = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
        if version >= SCHEMA_VERSION:
            return
        if "incidents" in tables:
            for step_version, step in MIGRATIONS:
                if step_version > max(version, 4):
                    step(db)
        for statement in _statements(SCHEMA):
            db.execute(schema_ddl(statement))
        db.execute(TRIGGERS)
        db.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (SCHEMA_VERSION, time.time()))


def connect(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection with the store's settings; creates or migrates the schema unless ``readonly``.

    ``path`` a ``postgresql://`` URL: the store on PostgreSQL (``diag.triage.pg``), with the same surface.
    Raises ``StoreCorrupt`` when the file is not a triage store (see the module docstring).
    """
    from diag.triage import pg

    if pg.is_url(path):
        conn = pg.PgConnection(str(path), readonly=readonly)  # an unreachable server: OperationalError, one line
        if not readonly:
            try:
                ensure_schema_pg(conn)
            except BaseException:
                conn.close()
                raise
        return conn  # type: ignore[return-value]
    if str(path).startswith(("postgresql:/", "postgres:/")):  # a URL that went through Path(): never a file to create
        raise ValueError(f"{path}: a PostgreSQL URL folded into a path (pass the URL as a string)")
    path = Path(path)
    _check_header(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"no triage store at {path}")
        db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True, timeout=10.0, check_same_thread=False)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    try:
        db.execute("PRAGMA busy_timeout = 10000")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and "incidents" not in tables:  # before any pragma below could change someone else's file
            listed = ", ".join(sorted(tables)[:5])
            raise StoreCorrupt(path, f"a SQLite database of something else: tables {listed}", foreign=True)
        if readonly:
            if not tables:
                raise StoreCorrupt(path, "an empty SQLite database, no incidents table")
        else:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            _ensure_schema(db, path)
            db.execute("PRAGMA foreign_keys = ON")
    except StoreCorrupt:
        db.close()
        raise
    except sqlite3.DatabaseError as exc:
        db.close()
        if _is_corruption(exc):
            raise StoreCorrupt(path, str(exc)) from None
        raise
    return db


def move_aside(path: str | Path, now: float | None = None) -> Path:
    """Rename a damaged store and its -wal/-shm to ``<name>.corrupt-<UTC time>`` (kept, not deleted: it is the
    evidence of what went wrong and may still hold incidents); the same naming as the flight recorder's."""
    from collectors.recorder import move_aside as move_recorder_aside

    return move_recorder_aside(Path(path), now)


def set_diagnosis(db: sqlite3.Connection, enabled: bool, now: float | None = None) -> int:
    """Record whether this receiver diagnoses (the triggers above read it). Turning it off also marks the
    incidents still waiting for a diagnosis as not diagnosed; returns how many."""
    now = time.time() if now is None else now
    with transaction(db):
        db.execute(
            "INSERT INTO settings (name, value) VALUES ('diagnosis', ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            ("on" if enabled else "off",),
        )
        if enabled:
            return 0
        waiting = [r[0] for r in db.execute("SELECT id FROM incidents WHERE diag_state IN ('pending', 'running')")]
        for incident_id in waiting:
            db.execute("UPDATE incidents SET diag_state = 'off' WHERE id = ?", (incident_id,))
            add_event(db, incident_id, "diagnosis_off", "not diagnosed: the receiver runs with --no-diagnosis", now)
    return len(waiting)


def get_setting(db: sqlite3.Connection, name: str) -> str | None:
    row = db.execute("SELECT value FROM settings WHERE name = ?", (name,)).fetchone()
    return None if row is None else str(row[0])


def set_setting(db: sqlite3.Connection, name: str, value: str) -> None:
    db.execute(
        "INSERT INTO settings (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value)
    )


@contextmanager
def transaction(db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE .. COMMIT (the write lock up front: no deadlock between two writers upgrading)."""
    db.execute(begin)
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def row_transaction(db: sqlite3.Connection) -> contextlib.AbstractContextManager[sqlite3.Connection]:
    """A transaction that only writes rows its caller owns -- a claimed outbox action, the ticket stored for it, an
    event -- and reads nothing to decide: on PostgreSQL it does not take the store's writer lock (``BEGIN
    DEFERRED``), on SQLite it is ``transaction``. Why: that lock serialises the lifecycle's read-then-write; the
    outbox queued behind the receivers' group commits for it twice per ticket, which capped two loaded receivers
    at under one ticket a second."""
    return transaction(db, "BEGIN DEFERRED" if is_shared(db) else "BEGIN IMMEDIATE")


CLAIM_LEASE_S = 60.0
"""How long a claim on an outbox action holds: longer than a sink's request deadline (10 s) with its lookup and
retries, so a live claimant always finishes first; a receiver killed mid-send has its claims taken over this
long after."""


def claim_outbox(db: sqlite3.Connection, outbox_id: int, now: float, lease_s: float = CLAIM_LEASE_S) -> bool:
    """Take an outbox action for this receiver; False when another one holds it (or it is done, failed). The row
    is locked ``FOR UPDATE SKIP LOCKED``: two receivers claiming at once never wait on each other, and exactly one
    wins. A SQLite store has one receiver, whose one dispatcher owns every action: nothing to claim (and no
    write, so no fsync, per action; a restarted receiver carries on at once with what it was sending)."""
    if not is_shared(db):
        return True
    cur = db.execute(
        "UPDATE outbox SET claimed_until = ? WHERE id = (SELECT id FROM outbox WHERE id = ? AND done_at IS NULL"
        " AND failed_at IS NULL AND (claimed_until IS NULL OR claimed_until <= ?) FOR UPDATE SKIP LOCKED)",
        (now + lease_s, outbox_id, now),
    )
    return cur.rowcount == 1


def add_event(db: sqlite3.Connection, incident_id: int, kind: str, text: str, ts: float | None = None) -> None:
    db.execute(
        "INSERT INTO events (incident_id, ts, kind, text) VALUES (?, ?, ?, ?)",
        (incident_id, time.time() if ts is None else ts, kind, text),
    )


def bump_stat(db: sqlite3.Connection, name: str, by: int = 1) -> None:
    db.execute(
        "INSERT INTO stats (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = stats.value + ?", (name, by, by)
    )


@dataclass
class IncidentView:
    """One incident as the CLI, the web page and the sinks show it."""

    row: dict[str, Any]
    alerts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    tickets: list[dict[str, Any]]
    ticket_failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def id(self) -> int:
        return int(self.row["id"])

    @property
    def diagnosis(self) -> dict[str, Any] | None:
        doc = self.row.get("diag_doc")
        return json.loads(doc) if doc else None

    def to_dict(self) -> dict[str, Any]:
        row = dict(self.row)
        for name in ("key_labels", "labels", "annotations"):
            row[name] = json.loads(row[name])
        row["diagnosis"] = self.diagnosis
        row.pop("diag_doc", None)
        return {
            "incident": row,
            "alerts": [{**a, "labels": json.loads(a["labels"])} for a in self.alerts],
            "events": self.events,
            "tickets": self.tickets,
            "ticket_failures": self.ticket_failures,
        }


def list_incidents(db: sqlite3.Connection, *, status: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    sql = (
        "SELECT id, key, generation, title, status, resolution, severity, starts_at, opened_at, updated_at, resolved_at,"
        " closed_at, reopen_count, flapping, diag_state, diag_class, key_labels,"
        " (SELECT COUNT(*) FROM alerts a WHERE a.incident_id = incidents.id) AS alert_count,"
        " (SELECT COUNT(*) FROM outbox o WHERE o.incident_id = incidents.id AND o.failed_at IS NOT NULL) AS ticket_failures"
        " FROM incidents"
    )
    args: list[Any] = []
    if status:
        sql += " WHERE status = ?"
        args.append(status)
    sql += " ORDER BY updated_at DESC, id DESC LIMIT ?"
    args.append(limit)
    return [dict(r) for r in db.execute(sql, args)]


def get_incident(db: sqlite3.Connection, incident_id: int) -> IncidentView | None:
    row = db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
    if row is None:
        return None
    alerts = [dict(r) for r in db.execute("SELECT * FROM alerts WHERE incident_id = ? ORDER BY first_seen", (incident_id,))]
    events = [dict(r) for r in db.execute("SELECT ts, kind, text FROM events WHERE incident_id = ? ORDER BY id", (incident_id,))]
    tickets = [
        dict(r)
        for r in db.execute(
            "SELECT sink, external_id, url, created_at FROM tickets WHERE incident_id = ? ORDER BY sink", (incident_id,)
        )
    ]
    failures = [
        dict(r)
        for r in db.execute(
            "SELECT sink, action, failed_at, last_error AS error FROM outbox WHERE incident_id = ? AND failed_at IS NOT NULL"
            " ORDER BY id",
            (incident_id,),
        )
    ]
    return IncidentView(dict(row), alerts, events, tickets, failures)
