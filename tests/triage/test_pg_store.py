"""The triage store on a real PostgreSQL 15: the dialect layer, the shared schema, claims between receivers, a
foreign database refused, and a receiver that answers 503 while the database is away and recovers on its own."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from types import SimpleNamespace

import httpx
import psycopg
import pytest

from diag.triage import lifecycle, payload
from diag.triage.diagnosis import DiagnosisWorker
from diag.triage.pg import redact, translate
from diag.triage.store import SCHEMA_VERSION, StoreCorrupt, claim_outbox, connect, list_incidents, transaction
from tests.pgserver import reset
from tests.triage.helpers import ReceiverProcess, alert, body

BASE = {"alertname": "ErrorBudgetBurnFast", "job": "llm-api", "instance": "10.0.0.5:8000", "severity": "page"}


def run(db, policy, doc, now):
    with transaction(db):
        return lifecycle.apply(db, policy, payload.parse(json.dumps(doc).encode()), now)


def test_translation_rewrites_placeholders_and_inserts_but_not_string_literals():
    assert translate("SELECT '?', x FROM t WHERE a = ? AND b LIKE 'a%'") == "SELECT '?', x FROM t WHERE a = %s AND b LIKE 'a%%'"
    ignore = translate("INSERT OR IGNORE INTO tickets (a) VALUES (?)")
    assert ignore == "INSERT INTO tickets (a) VALUES (%s) ON CONFLICT DO NOTHING"
    assert translate("INSERT INTO events (a) VALUES (?)").endswith("RETURNING id")
    assert not translate("INSERT INTO alerts (a) VALUES (?)").endswith("RETURNING id")  # no id column
    assert redact("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    hidden = redact("postgresql://u@h/db?sslmode=require&password=s3cret&sslpassword=k3y&application_name=x")
    assert hidden == "postgresql://u@h/db?sslmode=require&password=***&sslpassword=***&application_name=x"
    assert redact("postgres://h/db?PASSWORD=a&user=u") == "postgres://h/db?PASSWORD=***&user=u"
    assert redact("postgresql://h/db?user=password") == "postgresql://h/db?user=password"  # a value, not the key


@pytest.fixture
def url(pg_server):
    reset(pg_server.url)
    return pg_server.url


@pytest.mark.process
def test_receivers_starting_together_create_the_schema_once(url):
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            connect(url).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    db = connect(url)
    assert db.execute("SELECT version FROM schema_migrations").fetchall() == [(SCHEMA_VERSION,)]
    db.close()


@pytest.mark.process
def test_another_programs_database_is_refused_untouched(url):
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("CREATE TABLE customers (id int)")
    with pytest.raises(StoreCorrupt) as err:
        connect(url)
    assert err.value.foreign and "customers" in str(err.value)
    with psycopg.connect(url, autocommit=True) as other:
        names = {r[0] for r in other.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert names == {"customers"}


def _one_incident_with_a_create(db) -> int:
    run(db, lifecycle.Policy(sinks=("github",)), body(alert(BASE)), time.time())
    return db.execute("SELECT id FROM outbox WHERE action = 'create'").fetchone()[0]


@pytest.mark.process
def test_exactly_one_receiver_claims_an_outbox_action_until_its_lease_lapses(url):
    a, b = connect(url), connect(url)
    try:
        item = _one_incident_with_a_create(a)
        now = time.time()
        wins = []
        barrier = threading.Barrier(2)

        def claim(db) -> None:
            barrier.wait()
            wins.append(claim_outbox(db, item, now, lease_s=30))

        threads = [threading.Thread(target=claim, args=(db,)) for db in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(wins) == [False, True]
        assert not claim_outbox(a, item, now + 29, lease_s=30)  # still held
        assert claim_outbox(b, item, now + 31, lease_s=30)  # its claimant died: taken over
        a.execute("UPDATE outbox SET done_at = ? WHERE id = ?", (now, item))
        assert not claim_outbox(b, item, now + 100, lease_s=30)  # done: nothing to claim
    finally:
        a.close()
        b.close()


@pytest.mark.process
def test_a_diagnosis_is_claimed_by_one_receiver_and_taken_over_only_when_its_claim_lapses(url):
    a, b = connect(url), connect(url)
    try:
        _one_incident_with_a_create(a)
        first = DiagnosisWorker._claim(SimpleNamespace(_db=a))  # type: ignore[arg-type]
        second = DiagnosisWorker._claim(SimpleNamespace(_db=b))  # type: ignore[arg-type]
        assert first is not None and second is None
        with transaction(a) as db:  # as if its receiver died an analysis deadline ago
            db.execute("UPDATE incidents SET diag_claimed_until = ? WHERE id = ?", (time.time() - 1, first["id"]))
        again = DiagnosisWorker._claim(SimpleNamespace(_db=b))  # type: ignore[arg-type]
        assert again is not None and again["id"] == first["id"] and again["diag_attempts"] == 1
    finally:
        a.close()
        b.close()


@pytest.mark.process
def test_a_store_call_while_postgres_is_down_fails_as_a_db_api_error_and_the_next_one_reconnects(url, pg_server):
    db = connect(url)
    try:
        pg_server.stop()
        with pytest.raises(sqlite3.OperationalError):
            list_incidents(db)
        with pytest.raises(sqlite3.OperationalError), transaction(db):
            pass
        pg_server.start()
        assert list_incidents(db) == []
    finally:
        db.close()


@pytest.mark.process
def test_the_receiver_answers_503_while_postgres_is_away_and_recovers_when_it_returns(url, pg_server, tmp_path):
    rx = ReceiverProcess(url, "--no-diagnosis", log_dir=tmp_path).start()
    try:
        assert rx.post(body(alert({**BASE, "instance": "a"}))).status_code == 200
        pg_server.stop()
        down = rx.post(body(alert({**BASE, "instance": "b"})))
        assert down.status_code == 503, down.text
        pg_server.start()
        deadline = time.monotonic() + 30
        while (status := rx.post(body(alert({**BASE, "instance": "b"}))).status_code) != 200:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.1)
        with httpx.Client() as client:
            titles = client.get(f"{rx.url}/api/incidents", timeout=10).json()
        assert len(titles) == 2
    finally:
        rx.stop()


@pytest.mark.process
def test_serve_with_an_unreachable_postgres_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from tests.promserver import free_port

    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "diag.cli", "triage", "serve", "--no-diagnosis", "--db",
         f"postgresql://diag:hunter2@127.0.0.1:{port}/triage"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot open the triage store" in lines[0] and "Connection refused" in lines[0]
    assert "hunter2" not in out.stderr and "Traceback" not in out.stderr
