"""The GitHub sink against a local server following the GitHub REST API 2022-11-28 (``tests/triage/wire_github.py``):
create with the marker label and a Markdown body, comment, close as completed or not planned, reopen; the version
header and the token on every request; pull requests carrying the marker are not taken for the ticket; GitHub's
rate-limit answer (403 with ``X-RateLimit-Remaining: 0``) waits for the reset instead of failing for good."""

from __future__ import annotations

import time

import pytest

from diag.triage import lifecycle
from diag.triage.outbox import Dispatcher, marker
from diag.triage.sinks import GitHubSink
from diag.triage.store import transaction
from tests.triage.ticketkit import drain, fire, outbox, resolve, store
from tests.triage.wire_github import GitHub

pytestmark = pytest.mark.process


@pytest.fixture
def github():
    server = GitHub()
    yield server
    server.close()


def test_create_comment_close_reopen_wontfix(tmp_path, github):
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "gh-token", github.url)}, page_url="http://t.local", start=False)
    fire(db, policy, 100.0, summary="KV cache full", description="a `tick` and *stars* and <b>tags</b>")
    drain(d)
    (issue,) = github.issues.values()
    mark = marker(db.execute("SELECT * FROM incidents").fetchone())
    assert [x["name"] for x in issue["labels"]] == [mark]
    assert issue["title"].startswith("[llm-diag] KV cache full")
    assert "`alertname=KVCachePressure`" in issue["body"]
    assert r"a \`tick\` and \*stars\* and \<b\>tags\</b\>" in issue["body"]  # alert text is escaped, never markup
    assert "[http://t.local/incidents/1](<http://t.local/incidents/1>)" in issue["body"]

    resolve(db, policy, 100.0, 200.0)
    drain(d)
    assert (issue["state"], issue["state_reason"]) == ("closed", "completed")
    assert "Resolved" in issue["comments"][-1]
    fire(db, policy, 300.0)
    drain(d)
    assert (issue["state"], issue["state_reason"]) == ("open", "reopened")
    with transaction(db):
        lifecycle.close_by_person(db, policy, 1, wontfix=True, note="known noisy canary", now=400.0)
    drain(d)
    assert (issue["state"], issue["state_reason"]) == ("closed", "not_planned")
    assert "known noisy canary" in issue["comments"][-1]
    assert all(r.headers["x-github-api-version"] == "2022-11-28" for r in github.requests)
    assert all(r.headers["authorization"] == "Bearer gh-token" for r in github.requests)
    assert all(r["done_at"] for r in outbox(db)) and len(github.issues) == 1
    d.close()
    db.close()


def test_pull_requests_with_the_marker_are_not_the_ticket(github):
    sink = GitHubSink("acme/incidents", "gh-token", github.url)
    github.add_pull_request(["llmdiag-abc-g1"])
    assert sink.find("llmdiag-abc-g1") is None
    (lookup,) = github.seen("GET")
    assert lookup.query["state"] == "all" and lookup.query["labels"] == "llmdiag-abc-g1"


def test_the_rate_limit_waits_for_its_reset(tmp_path, github):
    reset = int(time.time()) + 40
    github.fail(403, doc={"message": "API rate limit exceeded"},
                headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)})  # fmt: skip
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "gh-token", github.url)}, base_backoff_s=0.01, start=False)
    fire(db, policy, 100.0)
    drain(d)
    (row,) = outbox(db)
    assert row["failed_at"] is None and "rate limited" in row["last_error"]
    assert reset - 2 <= row["next_at"] <= reset + 1  # the reset GitHub gave, not the 10 ms backoff
    d.close()
    db.close()


def test_a_wrong_token_fails_for_good(tmp_path, github):
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "wrong", github.url)}, base_backoff_s=0.01, start=False)
    fire(db, policy, 100.0)
    for _ in range(3):
        drain(d)
    (row,) = outbox(db)
    assert row["failed_at"] is not None and "HTTP 401: Bad credentials" in row["last_error"]
    assert len(github.requests) == 1
    d.close()
    db.close()
