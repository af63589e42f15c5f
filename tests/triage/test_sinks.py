"""GitHub Issues and Jira sinks fed by the outbox, against ``FakeTracker`` (a local server speaking the GitHub issue
endpoints and Jira Data Center's REST v2 ones): create once, comment, close, reopen; a sink that is down loses
nothing and catches up in order; a ticket created just before a crash is found again, not duplicated.
The per-tracker suites (``test_sink_*.py``) test each documented API in depth."""

from __future__ import annotations

import time

import pytest

from diag.triage import lifecycle
from diag.triage.outbox import Dispatcher, marker
from diag.triage.sinks import GitHubSink, JiraSink, Notice, SinkError
from diag.triage.sinks.text import from_plain
from diag.triage.store import connect, transaction
from tests.triage.helpers import FakeTracker, alert, body
from tests.triage.ticketkit import apply, drain
from tests.triage.wire_jira import JiraDataCenter

pytestmark = pytest.mark.process

LABELS = {"alertname": "KVCachePressure", "job": "llm", "instance": "10.0.0.5:8000"}


@pytest.fixture
def tracker():
    t = FakeTracker()
    yield t
    t.close()


def sinks(tracker: FakeTracker) -> dict:
    return {
        "github": GitHubSink("acme/incidents", "gh-token", tracker.url),
        "jira": JiraSink(tracker.url, "OPS", user="bot", token="jira-token", deployment="datacenter"),
    }


def test_create_once_then_close_reopen_comment_on_both_trackers(tmp_path):
    tracker = FakeTracker()
    policy = lifecycle.Policy(hold_down_s=0, reopen_window_s=3600, sinks=("github", "jira"))
    db = connect(tmp_path / "t.db")
    d = Dispatcher(tmp_path / "t.db", sinks(tracker), page_url="http://triage.local:9095", start=False)  # driven by hand
    apply(db, policy, body(alert(LABELS, starts=100, summary="KV cache <full>")), 100.0)
    apply(db, policy, body(alert(LABELS, starts=100)), 101.0)  # a duplicate delivery queues nothing
    drain(d)
    assert len(tracker.gh_issues) == 1 and len(tracker.jira_issues) == 1
    issue = tracker.gh_issues[1]
    assert issue["title"].startswith("[llm-diag] KV cache <full>") and "http://triage.local:9095/incidents/1" in issue["body"]
    assert tracker.jira_issues["OPS-1"]["labels"] == issue["labels"]

    apply(db, policy, body(alert(LABELS, "resolved", starts=100)), 200.0)
    drain(d)
    assert issue["state"] == "closed" and issue["state_reason"] == "completed"
    assert tracker.jira_issues["OPS-1"]["status"] == "Done"

    apply(db, policy, body(alert(LABELS, starts=300)), 300.0)
    drain(d)
    assert issue["state"] == "open" and tracker.jira_issues["OPS-1"]["status"] == "To Do"
    assert any("reopened, 1 time(s) in all" in c for c in issue["comments"])
    assert tracker.creates() == 2  # one per tracker, ever
    rows = db.execute("SELECT sink, external_id FROM tickets ORDER BY sink").fetchall()
    assert [tuple(r) for r in rows] == [("github", "1"), ("jira", "OPS-1")]
    with transaction(db):
        lifecycle.close_by_person(db, policy, 1, wontfix=True, note="canary", now=400.0)
    drain(d)
    assert issue["state_reason"] == "not_planned"
    auth = set(tracker.auth)
    assert auth == {"Bearer gh-token", "Basic Ym90OmppcmEtdG9rZW4="}
    d.close()
    db.close()
    tracker.close()


def test_a_sink_that_is_down_loses_nothing_and_catches_up_in_order(tmp_path, tracker):
    policy = lifecycle.Policy(hold_down_s=0, sinks=("github",))
    db = connect(tmp_path / "t.db")
    tracker.down = True
    d = Dispatcher(tmp_path / "t.db", {"github": GitHubSink("acme/incidents", "", tracker.url)}, base_backoff_s=0.05)
    try:
        apply(db, policy, body(alert(LABELS, starts=100)), time.time())
        apply(db, policy, body(alert(LABELS, "resolved", starts=100)), time.time())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(tracker.calls) < 4:
            time.sleep(0.05)
        assert len(tracker.calls) >= 4  # retried, with backoff
        pending = db.execute("SELECT action, attempts, last_error FROM outbox WHERE done_at IS NULL ORDER BY id").fetchall()
        assert [r["action"] for r in pending] == ["create", "close"] and pending[0]["attempts"] >= 2
        assert "503" in pending[0]["last_error"]
        tracker.down = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and db.execute("SELECT COUNT(*) FROM outbox WHERE done_at IS NULL").fetchone()[0]:
            time.sleep(0.1)
        assert tracker.creates() == 1 and tracker.gh_issues[1]["state"] == "closed"
    finally:
        d.close()
        db.close()


def test_ticket_created_before_a_crash_is_found_not_duplicated(tmp_path, tracker):
    policy = lifecycle.Policy(sinks=("github",))
    db = connect(tmp_path / "t.db")
    apply(db, policy, body(alert(LABELS, starts=100)), 100.0)
    row = db.execute("SELECT * FROM incidents").fetchone()
    gh = GitHubSink("acme/incidents", "", tracker.url)
    notice = Notice("create", marker(row), "created, then the receiver died before storing the id", ())
    gh.create(notice)  # what the crash left behind
    d = Dispatcher(tmp_path / "t.db", {"github": gh})
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not db.execute("SELECT COUNT(*) FROM tickets").fetchone()[0]:
            time.sleep(0.05)
        assert tracker.creates() == 1
        assert db.execute("SELECT external_id FROM tickets").fetchone()[0] == "1"
        assert "found" in db.execute("SELECT text FROM events WHERE kind = 'ticket'").fetchone()[0]
    finally:
        d.close()
        db.close()


def test_jira_without_the_configured_transition_is_a_permanent_error():
    server = JiraDataCenter()
    try:
        jira = JiraSink(server.url, "OPS", token="dc-pat", resolve_transition="Resolve Issue", deployment="datacenter")
        ticket = jira.create(Notice("create", "m", "t", from_plain("b")))
        with pytest.raises(SinkError, match="offers no transition 'Resolve Issue'") as raised:
            jira.close(ticket, Notice("close", "m", "t", ()))
        assert raised.value.permanent  # the workflow has no such transition: retrying cannot add one
        with pytest.raises(ValueError):
            GitHubSink("not-a-repo", "")
    finally:
        server.close()
