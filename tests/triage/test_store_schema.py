"""The store's schema versions: a store written before versions were counted (version 1, its schema frozen below as
it shipped) is migrated in place when opened -- rows, ids and references kept, ``diag_state`` may be 'off', outbox
rows can fail and remember a sent create -- and opening it again changes nothing. A file that is not a store is
told apart: damaged (``StoreCorrupt``) or another program's SQLite database (``foreign``), never altered."""

from __future__ import annotations

import sqlite3

import pytest

from diag.triage.store import SCHEMA_VERSION, StoreCorrupt, connect, get_incident, set_diagnosis, transaction

V1_SCHEMA = """
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
CREATE TABLE IF NOT EXISTS stats (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""


def v1_store(path) -> None:
    db = sqlite3.connect(path)
    db.executescript(V1_SCHEMA)
    db.execute(
        "INSERT INTO incidents (id, key, key_labels, title, status, labels, annotations, starts_at, opened_at, updated_at,"
        " diag_state) VALUES (7, 'k7', '{}', 'old one', 'open', '{\"job\": \"llm\"}', '{}', 1, 1, 1, 'pending')"
    )
    db.execute("INSERT INTO events (incident_id, ts, kind, text) VALUES (7, 1, 'opened', 'firing')")
    db.execute("INSERT INTO outbox (incident_id, sink, action, created_at, next_at) VALUES (7, 'github', 'create', 1, 1)")
    db.execute("INSERT INTO tickets (incident_id, sink, external_id, created_at) VALUES (7, 'jira', 'OPS-3', 1)")
    db.commit()
    db.close()


def test_a_version_1_store_is_migrated_in_place_and_only_once(tmp_path):
    path = tmp_path / "triage.db"
    v1_store(path)
    db = connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    view = get_incident(db, 7)
    assert view is not None and view.row["title"] == "old one" and view.tickets[0]["external_id"] == "OPS-3"
    assert [e["kind"] for e in view.events] == ["opened"]
    row = dict(db.execute("SELECT * FROM outbox").fetchone())
    assert row["failed_at"] is None and row["sent_at"] is None and row["action"] == "create"
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    with pytest.raises(sqlite3.IntegrityError):  # the incidents table is referenced again after the rebuild
        db.execute("INSERT INTO events (incident_id, ts, kind, text) VALUES (99, 1, 'x', 'y')")
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'incidents'")}
    assert {"incidents_diag", "incidents_due"} <= indexes
    assert set_diagnosis(db, False) == 1  # 'off' now passes the CHECK constraint
    assert db.execute("SELECT diag_state FROM incidents WHERE id = 7").fetchone()[0] == "off"
    schema = db.execute("SELECT group_concat(sql, ';') FROM sqlite_master").fetchone()[0]
    db.close()
    again = connect(path)  # idempotent: nothing left to do
    assert again.execute("SELECT group_concat(sql, ';') FROM sqlite_master").fetchone()[0] == schema
    assert again.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 1
    again.close()


def test_diagnosis_off_marks_new_and_reopened_incidents_in_the_same_statement(tmp_path):
    db = connect(tmp_path / "t.db")
    set_diagnosis(db, False)
    with transaction(db):
        db.execute(
            "INSERT INTO incidents (key, key_labels, title, status, labels, annotations, starts_at, opened_at, updated_at,"
            " diag_state) VALUES ('k', '{}', 't', 'open', '{}', '{}', 1, 1, 1, 'pending')"
        )
    assert db.execute("SELECT diag_state FROM incidents").fetchone()[0] == "off"
    set_diagnosis(db, True)
    with transaction(db):
        db.execute("UPDATE incidents SET diag_state = 'pending'")  # what a reopen asks for
    assert db.execute("SELECT diag_state FROM incidents").fetchone()[0] == "pending"
    db.close()


def test_files_that_are_not_stores_are_told_apart_and_left_alone(tmp_path):
    noise = tmp_path / "noise.db"
    noise.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(StoreCorrupt) as raised:
        connect(noise)
    assert not raised.value.foreign and "SQLite header" in raised.value.detail
    other = tmp_path / "recorder.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE records (ts REAL)")
    db.commit()
    db.close()
    before = other.read_bytes()
    with pytest.raises(StoreCorrupt) as raised:
        connect(other)
    assert raised.value.foreign and "tables records" in raised.value.detail
    assert other.read_bytes() == before and noise.read_bytes() == bytes(range(256)) * 20
