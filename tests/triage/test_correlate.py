"""One problem, one incident: alerts about the same problem on the same target join one incident.

Real SQLite store, real webhook bodies through ``payload.parse`` and ``lifecycle.apply``; a diagnosis is
stored the way ``DiagnosisWorker._store`` stores it (class, then ``release_ticket_hold`` and
``join_same_problem``), so these tests need no worker process.
"""

from __future__ import annotations

import json

import pytest

from diag.triage import lifecycle, payload
from diag.triage.store import connect, get_incident, transaction
from tests.triage.helpers import alert, body

SLO_PAGE = {"alertname": "LLMDiagSLOBurn", "slo": "queue-wait", "tier": "fast", "job": "llm-backend", "model": "demo",
            "severity": "page"}  # fmt: skip
CAUSE = {"alertname": "LLMDiagQueueWaitDominates", "diag_class": "queue_backlog", "job": "llm-backend", "model": "demo",
         "severity": "ticket"}  # fmt: skip
LIVE = {"alertname": "LLMDiagIncident", "diag_class": "queue_backlog", "class": "queue_backlog", "job": "llm-diag-host",
        "instance": "node-1", "severity": "ticket"}  # fmt: skip
OOM = {"alertname": "LLMDiagOOMKill", "diag_class": "host_oom", "job": "llm-diag-host", "instance": "node-1",
       "severity": "page"}  # fmt: skip
POLICY = lifecycle.Policy(hold_down_s=60, sinks=("github",), ticket_hold_s=120)


@pytest.fixture
def db(store_target):
    conn = connect(store_target)
    yield conn
    conn.close()


def fire(db, labels, now, *, status="firing", policy=POLICY):
    with transaction(db):
        return lifecycle.apply(db, policy, payload.parse(json.dumps(body(alert(labels, status))).encode()), now)


def diagnosed(db, incident_id, cls, now, policy=POLICY):
    """What DiagnosisWorker._store does once the analysis is in."""
    with transaction(db):
        db.execute("UPDATE incidents SET diag_state = 'done', diag_class = ? WHERE id = ?", (cls, incident_id))
        lifecycle.release_ticket_hold(db, incident_id, now)
        return lifecycle.join_same_problem(db, policy, incident_id, now)


def active(db):
    return [dict(r) for r in db.execute("SELECT * FROM incidents WHERE status != 'closed' ORDER BY id")]


def pending_creates(db, now):
    return [tuple(r) for r in db.execute(
        "SELECT incident_id, next_at <= ? FROM outbox WHERE action = 'create' AND done_at IS NULL ORDER BY incident_id", (now,)
    )]  # fmt: skip


def test_slo_page_cause_and_live_diagnosis_become_one_paging_incident(db):
    assert fire(db, SLO_PAGE, 1000.0) == ["opened"]
    assert fire(db, CAUSE, 1010.0) == ["opened"]
    # the two alerts that state their class join at once: the live diagnosis names no model, the cause no instance
    assert fire(db, LIVE, 1020.0) == ["opened"]
    assert len(active(db)) == 2
    # the SLO page states no class: it joins once its diagnosis concludes the same one
    assert diagnosed(db, 1, "queue_backlog", 1030.0) == 1
    (one,) = active(db)
    assert (one["id"], one["severity"], one["status"]) == (1, "page", "open")
    view = get_incident(db, 1)
    assert {json.loads(a["labels"])["alertname"] for a in view.alerts} == {SLO_PAGE["alertname"], CAUSE["alertname"],
                                                                            LIVE["alertname"]}  # fmt: skip
    joined = [e["text"] for e in view.events if e["kind"] == "joined"]
    assert len(joined) == 1 and joined[0].startswith("incident 2 joined")  # 3 had joined 2 before
    for absorbed in (2, 3):
        row = dict(db.execute("SELECT status, resolution FROM incidents WHERE id = ?", (absorbed,)).fetchone())
        assert row == {"status": "closed", "resolution": "merged"}
    # one ticket will be filed: the survivor's; the others' creates are cancelled, not held
    assert pending_creates(db, 1030.0) == [(1, 1)]


def test_a_joined_key_keeps_following_its_incident_until_every_alert_stops(db):
    fire(db, SLO_PAGE, 1000.0)
    fire(db, CAUSE, 1005.0)
    diagnosed(db, 1, "queue_backlog", 1010.0)
    assert fire(db, CAUSE, 1020.0) == ["duplicate"]  # a repeat of the joined alert lands on the survivor
    assert fire(db, SLO_PAGE, 1030.0, status="resolved") == ["partial"]  # the cause alert still fires
    assert fire(db, CAUSE, 1040.0, status="resolved") == ["resolving"]
    assert [(r["id"], r["status"]) for r in active(db)] == [(1, "resolving")]


def test_the_stated_class_wins_an_oom_page_never_joins_a_queue_diagnosis(db):
    fire(db, SLO_PAGE, 1000.0)
    fire(db, OOM, 1005.0)
    diagnosed(db, 2, "queue_backlog", 1006.0)  # the host's diagnosis while someone else's process was OOM-killed
    assert diagnosed(db, 1, "queue_backlog", 1010.0) is None
    assert len(active(db)) == 2


@pytest.mark.parametrize(
    ("other", "joins"),
    [
        ({**CAUSE, "instance": "node-2"}, True),  # the SLO names no instance: compatible with any of the job's
        ({**CAUSE, "model": "other"}, False),  # another model
        ({**CAUSE, "model_name": "demo", "model": ""}, True),  # vLLM's model_name counts as model
        ({**CAUSE, "diag_class": "thrashing"}, False),  # another class
    ],
)
def test_targets_must_not_disagree_and_classes_must_match(db, other, joins):
    fire(db, SLO_PAGE, 1000.0)
    fire(db, {k: v for k, v in other.items() if v}, 1005.0)
    diagnosed(db, 1, "queue_backlog", 1010.0)
    assert len(active(db)) == (1 if joins else 2)


def test_two_hosts_same_class_stay_two_incidents(db):
    fire(db, LIVE, 1000.0)
    fire(db, {**LIVE, "instance": "node-2"}, 1001.0)
    assert len(active(db)) == 2


def test_incidents_opened_further_apart_than_the_window_stay_apart(db):
    policy = lifecycle.Policy(hold_down_s=60, sinks=("github",), correlate_window_s=600)
    fire(db, SLO_PAGE, 1000.0, policy=policy)
    fire(db, CAUSE, 1700.0, policy=policy)
    assert diagnosed(db, 1, "queue_backlog", 1710.0, policy) is None
    assert len(active(db)) == 2


def test_joining_can_be_turned_off(db):
    policy = lifecycle.Policy(sinks=("github",), correlate_labels=())
    fire(db, CAUSE, 1000.0, policy=policy)
    fire(db, LIVE, 1001.0, policy=policy)
    assert len(active(db)) == 2


def test_ticket_waits_for_the_diagnosis_then_is_released(db):
    fire(db, SLO_PAGE, 1000.0)
    assert pending_creates(db, 1001.0) == [(1, 0)]  # held: the diagnosis may still join it to another incident
    assert pending_creates(db, 1121.0) == [(1, 1)]  # never longer than the hold
    diagnosed(db, 1, "queue_backlog", 1005.0)
    assert pending_creates(db, 1005.0) == [(1, 1)]


def test_a_ticket_already_filed_is_handed_over_or_closed_as_a_duplicate(db):
    fire(db, SLO_PAGE, 1000.0)
    fire(db, {**CAUSE, "severity": "page"}, 1001.0)
    with transaction(db):  # the cause incident's ticket was filed before the SLO page was diagnosed
        db.execute("INSERT INTO tickets (incident_id, sink, external_id, url, created_at) VALUES (2, 'github', '7', 'u', 1002)")
        db.execute("INSERT INTO tickets (incident_id, sink, external_id, url, created_at) VALUES (2, 'jira', 'K-1', 'v', 1002)")
        db.execute("INSERT INTO tickets (incident_id, sink, external_id, url, created_at) VALUES (1, 'jira', 'K-2', 'w', 1002)")
    # both hold a ticket: the older one survives
    assert diagnosed(db, 1, "queue_backlog", 1010.0) == 1
    tickets = {(r["incident_id"], r["sink"], r["external_id"]) for r in db.execute("SELECT * FROM tickets")}
    assert tickets == {(1, "github", "7"), (1, "jira", "K-2"), (2, "jira", "K-1")}  # github handed over
    open_closes = db.execute("SELECT * FROM outbox WHERE action = 'close' AND done_at IS NULL")
    closes = [(r["incident_id"], r["sink"]) for r in open_closes]
    assert closes == [(2, "jira")]  # the duplicate Jira issue is closed, no GitHub issue is created to be closed
    comments = [r["text"] for r in db.execute("SELECT * FROM outbox WHERE incident_id = 1 AND action = 'comment'")]
    assert comments and "was incident 2" in comments[0]


def test_a_new_alert_joining_a_diagnosed_incident_asks_for_its_diagnosis_again(db):
    """An OOM page opened on one kill is diagnosed; the service's own kill fires a second alert of the same key a
    minute later: the diagnosis runs again, over a window that now holds it. A repeat of a known alert does not."""
    oom = {**OOM, "constraint": "CONSTRAINT_MEMCG"}
    fire(db, oom, 1000.0)
    with transaction(db):
        db.execute("UPDATE incidents SET diag_state = 'done', diag_class = 'host_oom' WHERE id = 1")
    assert fire(db, oom, 1010.0) == ["duplicate"]
    assert db.execute("SELECT diag_state FROM incidents WHERE id = 1").fetchone()[0] == "done"
    assert fire(db, {**oom, "alertname": "LLMDiagCgroupOOMKill", "cgroup": "/svc"}, 1060.0) == ["joined"]
    row = db.execute("SELECT diag_state, diag_requested FROM incidents WHERE id = 1").fetchone()
    assert tuple(row) == ("pending", 1060.0)
