"""The incident store: one SQLite file (WAL), the receiver's only durable state.

Why SQLite: embedded (the receiver is one process beside the agent), transactional, and its
``UNIQUE(key, generation)`` constraint is what makes duplicates impossible rather than unlikely --
several receiver threads, several Alertmanager peers and retries after a crash all race to insert
the same incident, and the constraint lets exactly one win. ``synchronous=FULL`` in WAL mode: a
commit is on disk (fsync'd) before the webhook answers 2xx, so an acknowledged alert survives
``kill -9`` and power loss alike; group commit (``diag.triage.ingest``) keeps that affordable.

Everything else -- diagnoses to run, tickets to file -- is a row here too (a transactional outbox),
so a crash between "incident changed" and "ticket updated" loses nothing.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    diag_state TEXT NOT NULL DEFAULT 'pending' CHECK (diag_state IN ('pending', 'running', 'done', 'failed')),
    diag_requested REAL,
    diag_class TEXT,
    diag_doc TEXT,
    diag_at REAL,
    diag_error TEXT,
    diag_attempts INTEGER NOT NULL DEFAULT 0,
    bundle_path TEXT,
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
    last_error TEXT
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
"""

STATUSES = ("open", "resolving", "resolved", "closed")


def connect(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection with the store's settings; creates the file and schema unless ``readonly``."""
    if readonly:
        if not Path(path).exists():
            raise FileNotFoundError(f"no triage store at {path}")
        db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, timeout=10.0, check_same_thread=False)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA busy_timeout = 10000")
    if not readonly:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA foreign_keys = ON")
        db.executescript(SCHEMA)
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE .. COMMIT (the write lock up front: no deadlock between two writers upgrading)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def add_event(db: sqlite3.Connection, incident_id: int, kind: str, text: str, ts: float | None = None) -> None:
    db.execute(
        "INSERT INTO events (incident_id, ts, kind, text) VALUES (?, ?, ?, ?)",
        (incident_id, time.time() if ts is None else ts, kind, text),
    )


def bump_stat(db: sqlite3.Connection, name: str, by: int = 1) -> None:
    db.execute("INSERT INTO stats (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = value + ?", (name, by, by))


@dataclass
class IncidentView:
    """One incident as the CLI, the web page and the sinks show it."""

    row: dict[str, Any]
    alerts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    tickets: list[dict[str, Any]]

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
        }


def list_incidents(db: sqlite3.Connection, *, status: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    sql = (
        "SELECT id, key, generation, title, status, resolution, severity, starts_at, opened_at, updated_at, resolved_at,"
        " closed_at, reopen_count, flapping, diag_state, diag_class, key_labels,"
        " (SELECT COUNT(*) FROM alerts a WHERE a.incident_id = incidents.id) AS alert_count FROM incidents"
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
    return IncidentView(dict(row), alerts, events, tickets)
