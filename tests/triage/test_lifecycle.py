"""Incident lifecycle on a real SQLite store: dedup, hold-down, reopen, flapping, won't-fix, staleness."""

from __future__ import annotations

import json

import pytest

from diag.triage import lifecycle, payload
from diag.triage.keys import incident_key, parse_key_labels
from diag.triage.store import connect, get_incident, transaction
from tests.triage.helpers import FIXTURE, alert, body

BASE = {"alertname": "ErrorBudgetBurnFast", "job": "llm-api", "instance": "10.0.0.5:8000", "severity": "page"}


@pytest.fixture
def db(store_target):
    conn = connect(store_target)
    yield conn
    conn.close()


def run(db, policy, doc, now):
    with transaction(db):
        return lifecycle.apply(db, policy, payload.parse(json.dumps(doc).encode()), now)


def sweep(db, policy, now):
    with transaction(db):
        return lifecycle.sweep(db, policy, now)


def incidents(db):
    return [dict(r) for r in db.execute("SELECT * FROM incidents ORDER BY id")]


def test_real_alertmanager_body_opens_one_incident(db):
    note = payload.parse(FIXTURE.read_bytes())
    assert note.alerts[0].fingerprint == "4eb55a262f4fff97" and note.truncated_alerts == 0
    with transaction(db):
        assert lifecycle.apply(db, lifecycle.Policy(), note, 1000.0) == ["opened"]
        assert lifecycle.apply(db, lifecycle.Policy(), note, 1001.0) == ["duplicate"]
    (inc,) = incidents(db)
    assert inc["status"] == "open" and json.loads(inc["key_labels"]) == {
        "alertname": "ErrorBudgetBurnFast", "job": "llm-api", "instance": "127.0.0.1:8000"}  # fmt: skip


def test_key_prefers_slo_and_ignores_group_key_and_other_labels():
    fast = {"alertname": "BurnFast", "slo": "ttft", "job": "llm", "severity": "page"}
    slow = {"alertname": "BurnSlow", "slo": "ttft", "job": "llm", "severity": "ticket"}
    assert incident_key(fast)[0] == incident_key(slow)[0]  # two tiers of one SLO: one incident
    assert incident_key(fast)[0] != incident_key({**fast, "slo": "e2e"})[0]
    assert incident_key({**fast, "diag_class": "memory_leak"})[1] == {"diag_class": "memory_leak", "job": "llm"}
    assert parse_key_labels("alertname, job") == ("alertname", "job")
    with pytest.raises(ValueError):
        parse_key_labels("al-ert")


def test_group_key_change_does_not_split_the_incident(db):
    policy = lifecycle.Policy()
    a = alert(BASE)
    run(db, policy, body(a, group_key='{}/{team="a"}:{alertname="X"}'), 100.0)
    run(db, policy, body(a, group_key='{}/{team="b"}:{alertname="X"}'), 101.0)
    assert len(incidents(db)) == 1


def test_every_fingerprint_is_kept_under_its_incident(db):
    policy = lifecycle.Policy(key_labels=("alertname", "job"))
    a1, a2 = alert({**BASE, "pod": "a"}), alert({**BASE, "pod": "b"})
    assert run(db, policy, body(a1, a2), 100.0) == ["opened", "joined"]
    view = get_incident(db, 1)
    assert {a["fingerprint"] for a in view.alerts} == {a1["fingerprint"], a2["fingerprint"]}
    # one of two resolves: still open
    assert run(db, policy, body(alert({**BASE, "pod": "a"}, "resolved"), a2), 110.0) == ["partial", "duplicate"]
    assert incidents(db)[0]["status"] == "open"


def test_hold_down_then_resolved_then_reopen_with_count_then_new_generation(db):
    policy = lifecycle.Policy(hold_down_s=60, reopen_window_s=600, flap_threshold=10, sinks=("github",))
    run(db, policy, body(alert(BASE, starts=100)), 100.0)
    assert run(db, policy, body(alert(BASE, "resolved", starts=100)), 200.0) == ["resolving"]
    assert sweep(db, policy, 259.0) == 0 and incidents(db)[0]["status"] == "resolving"
    assert sweep(db, policy, 261.0) == 1 and incidents(db)[0]["status"] == "resolved"
    # the late retry of the first firing (same startsAt) must not reopen it
    assert run(db, policy, body(alert(BASE, starts=100)), 270.0) == ["stale"]
    # a new firing (Alertmanager gives it a new startsAt) within the window reopens, re-diagnosis requested
    db.execute("UPDATE incidents SET diag_state = 'done', diag_class = 'memory_leak'")
    assert run(db, policy, body(alert(BASE, starts=300)), 300.0) == ["reopened"]
    (inc,) = incidents(db)
    assert (inc["status"], inc["reopen_count"], inc["diag_state"]) == ("open", 1, "pending")
    actions = [r[0] for r in db.execute("SELECT action FROM outbox ORDER BY id")]
    assert actions == ["create", "close", "reopen"]
    # resolved, then firing long after the reopen window: a new incident (generation 2), not a reopen
    run(db, policy, body(alert(BASE, "resolved", starts=300)), 400.0)
    sweep(db, policy, 461.0)
    assert run(db, policy, body(alert(BASE, starts=2000)), 2000.0) == ["opened"]
    rows = incidents(db)
    assert [(r["generation"], r["status"]) for r in rows] == [(1, "resolved"), (2, "open")]


def test_firing_during_hold_down_is_a_flap_and_flapping_is_marked(db):
    policy = lifecycle.Policy(hold_down_s=60, flap_window_s=3600, flap_threshold=4, sinks=("github",))
    run(db, policy, body(alert(BASE, starts=100)), 100.0)
    now, starts = 100.0, 100.0
    outcomes = []
    for _ in range(3):
        now += 10
        outcomes += run(db, policy, body(alert(BASE, "resolved", starts=starts)), now)
        now += 10
        starts = now
        outcomes += run(db, policy, body(alert(BASE, starts=starts)), now)
    assert outcomes == ["resolving", "refired"] * 3
    (inc,) = incidents(db)
    assert inc["flapping"] == 1 and inc["reopen_count"] == 0 and inc["status"] == "open"
    kinds = [r[0] for r in db.execute("SELECT kind FROM events ORDER BY id")]
    assert kinds.count("flapping") == 1
    # a flapping incident does not churn its ticket: resolving it queues no close
    run(db, policy, body(alert(BASE, "resolved", starts=starts)), now + 10)
    sweep(db, policy, now + 100)
    assert [r[0] for r in db.execute("SELECT action FROM outbox ORDER BY id")] == ["create", "comment"]
    # settles after a quiet flap window
    sweep(db, policy, now + 3800)
    assert incidents(db)[0]["flapping"] == 0


def test_closed_wontfix_never_reopens_closed_fixed_does(db):
    policy = lifecycle.Policy(hold_down_s=0, reopen_window_s=600)
    run(db, policy, body(alert(BASE, starts=100)), 100.0)
    with transaction(db):
        lifecycle.close_by_person(db, policy, 1, wontfix=True, note="known canary", now=110.0)
    for i in range(3):
        assert run(db, policy, body(alert(BASE, starts=200 + i)), 200.0 + i) == ["suppressed"]
    assert run(db, policy, body(alert(BASE, starts=9000)), 9000.0) == ["suppressed"]  # even after the window
    assert [(r["status"], r["resolution"]) for r in incidents(db)] == [("closed", "wontfix")]

    other = {**BASE, "alertname": "Other"}
    run(db, policy, body(alert(other, starts=100)), 100.0)
    with transaction(db):
        lifecycle.close_by_person(db, policy, 2, wontfix=False, note="", now=120.0)
    assert run(db, policy, body(alert(other, starts=130)), 130.0) == ["reopened"]
    with pytest.raises(LookupError):
        lifecycle.close_by_person(db, policy, 99, wontfix=True, note="", now=1.0)


def test_resolved_for_unknown_incident_stores_nothing(db):
    assert run(db, lifecycle.Policy(), body(alert(BASE, "resolved")), 100.0) == ["unknown"]
    assert incidents(db) == []


def test_unique_constraint_refuses_a_second_incident_for_one_key(db):
    import sqlite3

    run(db, lifecycle.Policy(), body(alert(BASE)), 100.0)
    row = incidents(db)[0]
    with pytest.raises(sqlite3.IntegrityError):
        db.execute(
            "INSERT INTO incidents (key, generation, key_labels, title, status, labels, annotations, starts_at, opened_at,"
            " updated_at) VALUES (?, 1, '{}', 't', 'open', '{}', '{}', 0, 0, 0)",
            (row["key"],),
        )
