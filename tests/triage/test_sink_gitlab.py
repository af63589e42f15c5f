"""The GitLab sink against a local server following the GitLab 17.x REST API v4 (``tests/triage/wire_gitlab.py``):
the project by URL-encoded path or numeric id, ``PRIVATE-TOKEN``, issues created with the marker label, notes,
``state_event`` close and reopen; the lookup asks for every state and scope, so a closed ticket is found again."""

from __future__ import annotations

import pytest

from diag.triage.outbox import Dispatcher, marker
from diag.triage.sinks import GitLabSink, Notice
from diag.triage.sinks.text import para, text
from tests.triage.ticketkit import drain, fire, outbox, resolve, store
from tests.triage.wire_gitlab import GitLab

pytestmark = pytest.mark.process


@pytest.fixture
def gitlab():
    server = GitLab(project="ops/llm-incidents", project_id=42)
    yield server
    server.close()


@pytest.mark.parametrize("project", ["ops/llm-incidents", "42"])
def test_create_note_close_reopen(tmp_path, gitlab, project):
    db, policy, path = store(tmp_path, ("gitlab",))
    d = Dispatcher(path, {"gitlab": GitLabSink(gitlab.url, project, "gl-token")}, page_url="http://t.local", start=False)
    fire(db, policy, 100.0, summary="KV cache full")
    drain(d)
    (issue,) = gitlab.issues.values()
    assert issue["labels"] == [marker(db.execute("SELECT * FROM incidents").fetchone())]
    assert "`alertname=KVCachePressure`" in issue["description"]
    resolve(db, policy, 100.0, 200.0)
    drain(d)
    assert issue["state"] == "closed" and "Resolved" in issue["notes"][-1]
    fire(db, policy, 300.0)
    drain(d)
    assert issue["state"] == "opened" and "reopened" in issue["notes"][-1]
    expected = "ops%2Fllm-incidents" if "/" in project else "42"
    assert {r.raw_path.split("/")[4] for r in gitlab.requests} == {expected}
    assert all(r.headers["private-token"] == "gl-token" for r in gitlab.requests)
    assert all(r["done_at"] for r in outbox(db))
    d.close()
    db.close()


def test_lookup_finds_a_closed_ticket(gitlab):
    sink = GitLabSink(gitlab.url, "ops/llm-incidents", "gl-token")
    ticket = sink.create(Notice("create", "llmdiag-abc-g1", "t", (para(text("b")),)))
    sink.close(ticket, Notice("close", "llmdiag-abc-g1", "t", ()))
    assert sink.find("llmdiag-abc-g1") == ticket
    lookup = gitlab.seen("GET")[-1]
    assert (lookup.query["scope"], lookup.query["state"]) == ("all", "all")
